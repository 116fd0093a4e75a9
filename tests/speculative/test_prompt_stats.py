"""Where eval's time goes, prompt by prompt: round times recorded by both loops, the per-prompt rows, the flagging
of prompts whose steady rounds are much slower than their method's median, and an evaluation over the engine in
which no prompt is decoded differently from the others."""

import importlib
import math

import pytest
import torch

from flashdraft.speculative import generate
from flashdraft.speculative.engine import session
from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.prompt_stats import SLOW_FACTOR, prompt_row, slow_prompts
from flashdraft.speculative.prompts import Prompt
from flashdraft.speculative.result import GenerationResult

from . import one_thread, random_drafter, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)

evaluate_module = importlib.import_module("flashdraft.speculative.evaluate")


def _row(prompt: int, steady: float, method: str = "dflash") -> dict:
    return {
        "prompt": prompt,
        "method": method,
        "category": "all",
        "prompt_tokens": 10,
        "new_tokens": 32,
        "prefill_ms": 1.0,
        "first_round_ms": 2.0,
        "steady_round_ms": steady,
        "rounds": 20,
        "tau": 1.6,
        "backend": "engine+graphs",
    }


def test_one_slow_prompt_is_named_and_a_uniform_set_names_none():
    uniform = [_row(i, 10.0 + 0.5 * i) for i in range(6)] + [_row(i, 1.0 + 0.1 * i, "autoregressive") for i in range(6)]
    assert slow_prompts(uniform) == []
    # Prompt 3 of DFlash at 4x the median; autoregressive decoding's 3.1 ms is no outlier among its own.
    rows = uniform[:3] + [_row(3, 45.0)] + uniform[4:]
    flagged = slow_prompts(rows)
    assert [(r["method"], r["prompt"]) for r in flagged] == [("dflash", 3)]
    median = sorted(r["steady_round_ms"] for r in rows if r["method"] == "dflash")[2:4]
    assert flagged[0]["median_steady_round_ms"] == pytest.approx(sum(median) / 2)
    assert flagged[0]["times_median"] == pytest.approx(45.0 / flagged[0]["median_steady_round_ms"])
    assert flagged[0]["prefill_ms"] == 1.0 and flagged[0]["steady_round_ms"] == 45.0  # its numbers come along
    # Just under the factor is not flagged; a prompt with one round (no steady rounds) is neither counted nor named.
    assert slow_prompts([_row(0, 10.0), _row(1, 10.0), _row(2, SLOW_FACTOR * 10.0 - 1e-9)]) == []
    assert slow_prompts([_row(0, 10.0), _row(1, 10.0), _row(2, math.nan)]) == []
    # Slowest first.
    several = [_row(i, 10.0) for i in range(5)] + [_row(5, 30.0), _row(6, 50.0)]
    assert [r["prompt"] for r in slow_prompts(several)] == [6, 5]


def test_prompt_row_splits_the_time_into_prefill_first_and_steady_rounds():
    result = GenerationResult(tokens=list(range(9)), acceptance_lengths=[2, 3, 1, 2], num_prompt_tokens=17)
    result.time_to_first_token, result.round_times = 0.040, [0.012, 0.003, 0.005, 0.004]
    row = prompt_row(2, "code", "dflash", result)
    assert row["prompt"] == 2 and row["category"] == "code" and row["method"] == "dflash"
    assert (row["prompt_tokens"], row["new_tokens"], row["rounds"]) == (17, 9, 4)
    assert row["prefill_ms"] == pytest.approx(40.0) and row["first_round_ms"] == pytest.approx(12.0)
    assert row["steady_round_ms"] == pytest.approx(4.0)  # the median of the rounds after the first
    assert row["tau"] == 2.0 and "context_length" not in row
    assert prompt_row(0, "code", "dflash", result, context_length=1024)["context_length"] == 1024
    single = GenerationResult(tokens=[1, 2], acceptance_lengths=[1], round_times=[0.002])
    assert math.isnan(prompt_row(0, "c", "autoregressive", single)["steady_round_ms"])


@pytest.mark.parametrize("engine", [False, True])
def test_both_loops_time_every_round(engine):
    """One time per round; together they are the decode time (up to the last round's trailing work)."""
    target = tiny_target("qwen3", seed=3)
    drafter = random_drafter(target, block_size=4, seed=4, family="dspark")
    prompt = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(0))
    with ready(target):
        for result in (
            generate(target, drafter, prompt, 20, engine=engine),
            evaluate_module.autoregressive_generate(target, prompt, 20, engine=engine),
            evaluate_module.prompt_lookup_generate(target, prompt, 20, block_size=4, engine=engine),
        ):
            assert len(result.round_times) == result.num_rounds == len(result.drafts_accepted) > 1
            assert all(t > 0 for t in result.round_times)
            decode = result.total_time - result.time_to_first_token
            assert sum(result.round_times) <= decode * 1.001 and sum(result.round_times) > 0.5 * decode
    session.drop_session(target)


def test_no_prompt_is_decoded_differently_over_the_engine(monkeypatch):
    """Prompts of different lengths through `evaluate` on the engine (CPU, float64): every result on the same
    backend, no engine or drafter runner built while the prompts are timed (`evaluate` prepares one for the longest
    before), and no prompt's steady rounds over twice its method's median. A DSpark drafter whose anchor slot
    drafts verifies one token more than its block: the baselines must share its engine, not rebuild their own.

    Timing on a shared CPU is noisy: a prompt flagged once is decoded again, and only one flagged twice fails."""
    target = tiny_target("qwen3", seed=7)
    drafter = random_drafter(target, block_size=4, seed=8, family="dspark", sample_from_anchor=True)
    generator = torch.Generator().manual_seed(9)
    lengths = (3, 40, 9, 120, 25, 70)
    prompts = [Prompt(torch.randint(0, 255, (1, n), generator=generator), "all", i) for i, n in enumerate(lengths)]
    built = {"sessions": 0, "runners": 0}
    timed = {"on": False}

    class CountedSession(session.Session):
        def __init__(self, *args, **kwargs):
            built["sessions"] += timed["on"]
            super().__init__(*args, **kwargs)

    runner_init = DrafterRunner.__init__

    def counted_runner(self, *args, **kwargs):
        built["runners"] += timed["on"]
        runner_init(self, *args, **kwargs)

    decode_all = evaluate_module._decode_all

    def timed_decode_all(*args, **kwargs):
        timed["on"] = True
        try:
            return decode_all(*args, **kwargs)
        finally:
            timed["on"] = False

    monkeypatch.setattr(session, "Session", CountedSession)
    monkeypatch.setattr(DrafterRunner, "__init__", counted_runner)
    monkeypatch.setattr(evaluate_module, "_decode_all", timed_decode_all)
    flagged_before = None
    with ready(target):
        for _ in range(2):
            session.drop_session(target)
            report = evaluate_module.evaluate(target, drafter, prompts, max_new_tokens=40, progress=False, engine=True)
            rows = report["per_prompt"]
            assert len(rows) == len(prompts) * len(report["methods_run"])
            assert {r["backend"] for r in rows} == {"engine"} and report["backend"] == "engine"
            assert [r["prompt_tokens"] for r in rows if r["method"] == "dflash"] == list(lengths)
            assert all(r["rounds"] > 10 and not math.isnan(r["steady_round_ms"]) for r in rows)
            assert built == {"sessions": 0, "runners": 0}, "an engine was rebuilt while the prompts were timed"
            assert report["greedy_mismatches"] == 0
            flagged = {(r["method"], r["prompt"]) for r in report["slow_prompts"]}
            if not flagged or (flagged_before is not None and not flagged & flagged_before):
                break
            flagged_before = flagged
        else:
            pytest.fail(f"prompts slow in two evaluations: {report['slow_prompts']}")
    session.drop_session(target)
    assert report["prefill_ms"] > 0 and report["steady_speedup"] > 0
    for method, figures in report["methods"].items():
        assert figures["steady_round_ms"] > 0 and figures["first_round_ms"] > 0, method
