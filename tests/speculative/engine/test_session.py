"""Decoding over the engine is exact: greedy output equals the target's own greedy decoding (transformers, one
token per cached forward) and the plain loop's drafts and acceptance; sampling keeps the target's distribution."""

import pytest
import torch

from flashdraft.speculative import autoregressive_generate, generate, prompt_lookup_generate
from flashdraft.speculative.engine import session
from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.rounds import OneStepRound

from .. import one_thread, random_drafter, ready, reference_greedy, tiny_target  # noqa: F401 (autouse fixture)
from ..test_sampling import CASES, P_MIN, _sample_tokens_2_and_3
from . import CONFIGS

FAMILIES = ["qwen3_5", "qwen3"]
BLOCK_SIZES = (2, 4, 16)


@pytest.fixture(scope="module", params=[(f, c) for f in FAMILIES for c in CONFIGS], ids=lambda p: f"{p[0]}-{p[1].id}")
def setup(request):
    """(target, random drafter, prompts with the target's greedy continuations, device, graphs)."""
    family, config = request.param
    (device, dtype, graphs), marks = config.values[0], config.marks
    for mark in marks:
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    target = tiny_target(family, seed=11, dtype=dtype).to(device)
    drafter = random_drafter(target, block_size=16, seed=12).to(device)
    g = torch.Generator().manual_seed(13)
    with ready(target):
        cases = []
        for i in range(10):
            prompt_len = 1 if i == 0 else int(torch.randint(2, 41, (1,), generator=g))
            max_new = 50 if i < 2 else int(torch.randint(1, 40, (1,), generator=g))
            prompt = torch.randint(0, 256, (1, prompt_len), generator=g).to(device)
            cases.append((prompt, max_new, reference_greedy(target, prompt, max_new)))
        yield target, drafter, cases, device, graphs


def _check_stats(result, block_size):
    assert sum(result.acceptance_lengths) + 1 == len(result.tokens)
    assert all(1 <= a <= block_size for a in result.acceptance_lengths)
    assert all(0 <= a <= o for a, o in zip(result.position_accepted, result.position_offered, strict=True))
    assert all(a >= b for a, b in zip(result.position_accepted, result.position_accepted[1:], strict=False))
    assert result.num_target_forwards == 1 + result.num_rounds


def test_greedy_equals_target_greedy_and_the_plain_loop(setup):
    target, drafter, cases, device, graphs = setup
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases):
            bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            result = generate(target, drafter, prompt, max_new, block_size=bs, engine=True)
            assert result.backend == ("engine+graphs" if graphs else "engine")
            assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), block size {bs}"
            _check_stats(result, bs)
            if device == "cpu":  # float64: the same drafts, so the same acceptance, as transformers' forwards
                plain = generate(target, drafter, prompt, max_new, block_size=bs, engine=False)
                assert result.acceptance_lengths == plain.acceptance_lengths, f"prompt {i}"


@pytest.mark.parametrize("block_size,refine", [(4, (1, 2)), (16, (1, 3, 7))])
def test_refined_greedy_equals_target_greedy_and_the_plain_loop(setup, block_size, refine):
    target, drafter, cases, device, graphs = setup
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:6]):
            result = generate(target, drafter, prompt, max_new, block_size=block_size, engine=True, refine=refine)
            assert result.tokens == expected, f"prompt {i}, refine {refine}"
            _check_stats(result, block_size)
            if device == "cpu":
                plain = generate(target, drafter, prompt, max_new, block_size=block_size, engine=False, refine=refine)
                assert result.acceptance_lengths == plain.acceptance_lengths, f"prompt {i}"
        # Greedy only: sampling in passes needs the plain loop.
        with pytest.raises(ValueError, match="drafts in passes only greedily"):
            generate(target, drafter, prompt, 4, 1.0, block_size=block_size, engine=True, refine=refine)


def test_baselines_equal_target_greedy(setup):
    target, _, cases, _, _ = setup
    with ready(target):
        for prompt, max_new, expected in cases[:4]:
            ar = autoregressive_generate(target, prompt, max_new, engine=True)
            assert ar.tokens == expected and set(ar.acceptance_lengths) <= {1}
            pl = prompt_lookup_generate(target, prompt, max_new, block_size=8, engine=True)
            assert pl.tokens == expected
            _check_stats(pl, 8)
        prompt, max_new, expected = cases[0]
        assert max(prompt_lookup_generate(target, prompt, max_new, block_size=8, engine=True).acceptance_lengths) >= 3


@pytest.mark.parametrize(
    "family, anchor_drafts",
    [("dspark", True), ("dspark", False), ("dflash2", False)],
    ids=["dspark", "slots", "dflash2"],
)
def test_greedy_chained_drafter_equals_target_greedy_and_the_plain_loop(setup, family, anchor_drafts):
    """A DSpark or DFlash2 drafter over the engine: the walk inside the drafter's step, a verification one token
    wider when the anchor's slot drafts; the same tokens as the target and (float64) the same acceptance as the
    plain loop."""
    target, _, cases, device, graphs = setup
    fields = {"sample_from_anchor": anchor_drafts} if family == "dspark" else {}
    drafter = random_drafter(target, block_size=16, seed=14, family=family, **fields)
    drafter = drafter.to(device)
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:6]):
            bs = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            result = generate(target, drafter, prompt, max_new, block_size=bs, engine=True)
            assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), block size {bs}"
            _check_stats(result, bs + int(anchor_drafts))
            if device == "cpu":
                plain = generate(target, drafter, prompt, max_new, block_size=bs, engine=False)
                assert result.acceptance_lengths == plain.acceptance_lengths, f"prompt {i}"
    session.drop_session(target)


class ScriptedRunner(DrafterRunner):
    """Drafts a known continuation, wrong at `error_rate` (eagerly): acceptance lengths span 1 .. bs. It replaces
    the step's body, which the runner's own step and the greedy round (rounds.py) both run."""

    def __init__(self, drafter, engine, script, error_rate, seed):
        super().__init__(drafter, engine)
        self.script, self.error_rate = script, error_rate
        self.rng = torch.Generator().manual_seed(seed)

    def _draft(self):
        anchor = int(self.context + self.pending)
        self.context.fill_(anchor)
        self.pending.zero_()
        tokens = [self.script[p] if p < len(self.script) else 0 for p in range(anchor + 1, anchor + self.block_size)]
        wrong = (torch.rand(len(tokens), generator=self.rng) < self.error_rate).tolist()
        tokens = [(t + 1) % 256 if w else t for t, w in zip(tokens, wrong, strict=True)]
        self.drafts.copy_(torch.tensor(tokens))
        self.logits.zero_().scatter_(1, self.drafts[:, None], 8.0)


@pytest.mark.parametrize("block_size,error_rate", [(4, 0.3), (16, 0.08)])
def test_every_acceptance_length_and_stops(setup, block_size, error_rate):
    """Full blocks (nothing rolled back) and every partial acceptance; stop tokens and max_new_tokens exact."""
    target, drafter, cases, device, graphs = setup
    seen = set()
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:5]):
            sess = session.session(
                target, prompt.shape[1] + max_new, block_size, list(drafter.target_layer_ids), graphs
            )
            scripted = ScriptedRunner(drafter, sess.engine, prompt[0].tolist() + expected, error_rate, seed=i)
            sess.runners[(id(drafter), (0.0, 1.0, 0))] = scripted
            # Its round uncaptured, as the runner is: the script is read on the host.
            sess.rounds[(id(scripted), (), "block")] = OneStepRound(sess.engine, scripted)
            result = generate(target, drafter, prompt, max_new, block_size=block_size, engine=True)
            assert result.tokens == expected, f"prompt {i}"
            _check_stats(result, block_size)
            seen.update(a - 1 for a in result.acceptance_lengths[:-1])
            for n in sorted({1, 2, block_size - 1, block_size + 1, max_new} & set(range(1, max_new + 1))):
                assert generate(target, drafter, prompt, n, block_size=block_size, engine=True).tokens == expected[:n]
            stop = expected[len(expected) // 2]
            cut = expected[: expected.index(stop) + 1]
            result = generate(
                target, drafter, prompt, max_new, block_size=block_size, stop_token_ids=[stop], engine=True
            )
            assert result.tokens == cut and result.stopped
            # The round enqueued past the stop token is never read; the next generation starts afresh.
            assert generate(target, drafter, prompt, max_new, block_size=block_size, engine=True).tokens == expected
        session.drop_session(target)  # and the scripted runners with it
    assert {0, block_size - 1} <= seen


@pytest.mark.parametrize("refine", [(), (1, 3, 7)])
def test_engine_drafts_what_the_plain_loop_drafts_with_the_shipped_drafter(monkeypatch, refine):
    """The shipped trained drafter over the shipped target (float64, CPU), so that drafts are accepted — over a
    random drafter, equal acceptance proves little: (almost) nothing is accepted either way. Round by round the
    engine verifies exactly the drafts the plain loop verifies, and both emit the target's greedy output."""
    import importlib
    import json

    from transformers import AutoModelForCausalLM

    from flashdraft import bundled
    from flashdraft.drafter import DFlashDraftModel

    # The module: the package exports the function `generate` under the same name.
    plain_loop = importlib.import_module("flashdraft.speculative.generate")
    target = AutoModelForCausalLM.from_pretrained(bundled.target_dir(), dtype=torch.float64).eval()
    drafter = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float64).eval()
    tokenizer = bundled.load_tokenizer()
    drafts = {"engine": [], "plain": []}
    read, propose = OneStepRound.read, plain_loop.DFlashProposer.propose

    def engine_round(greedy):
        values = read(greedy)
        drafts["engine"][-1].append(values[2])  # the round's verified drafts
        return values

    def plain_round(self, tokens, num_drafts):
        proposed, probs = propose(self, tokens, num_drafts)
        drafts["plain"][-1].append(proposed.tolist())
        return proposed, probs

    monkeypatch.setattr(OneStepRound, "read", engine_round)
    monkeypatch.setattr(plain_loop.DFlashProposer, "propose", plain_round)
    lines = bundled.eval_prompts().read_text().splitlines()[:4]
    accepted = rounds = 0
    with ready(target):
        for i, line in enumerate(lines):
            prompt = tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids[:, -48:]
            for name in drafts:
                drafts[name].append([])
            on = generate(target, drafter, prompt, 40, engine=True, refine=refine)
            off = generate(target, drafter, prompt, 40, engine=False, refine=refine)
            assert on.backend == "engine" and off.backend == "plain"
            # Greedy: each token is the argmax after the ones before it (one forward without cache checks all).
            with torch.inference_mode():
                logits = target(torch.cat([prompt[0], torch.tensor(on.tokens)])[None]).logits[0, prompt.shape[1] - 1 :]
            assert on.tokens == off.tokens == logits[:-1].argmax(-1).tolist(), f"prompt {i}"
            # The engine verifies a whole block each round; near the end the plain loop asks for fewer drafts.
            engine_drafts, plain_drafts = drafts["engine"][-1], drafts["plain"][-1]
            assert len(engine_drafts) == len(plain_drafts), f"prompt {i}: rounds"
            trimmed = [e[: len(d)] for e, d in zip(engine_drafts, plain_drafts, strict=True)]
            assert trimmed == plain_drafts, f"prompt {i}: the engine drafted other tokens"
            assert on.acceptance_lengths == off.acceptance_lengths, f"prompt {i}"
            accepted += sum(a - 1 for a in on.acceptance_lengths)
            rounds += on.num_rounds
    session.drop_session(target)
    print(f"\nshipped drafter: {accepted / rounds:.2f} drafts accepted per round ({rounds} rounds)")
    assert accepted / rounds > 1.5  # a drafter that is read wrongly (or a random one) accepts ~0


@pytest.mark.distribution
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", [case for case, (*_, refine, _, _) in CASES.items() if not refine])
def test_speculative_sampling_equals_target_distribution(case, config):
    """As tests/speculative/test_sampling.py, through the engine (device-side rejection sampling, commits; DSpark's
    drafts drawn inside the drafter's step); the engine drafts in passes only greedily."""
    device, _, _ = config
    pvalue, accepted_any, trials = _sample_tokens_2_and_3(*CASES[case], device=device, engine=True)
    assert pvalue > P_MIN, f"{case}: p-value {pvalue:.3g}"
    assert 0.05 * trials < accepted_any < 0.95 * trials


def test_sessions_are_reused_and_grown():
    target = tiny_target("qwen3", seed=0)
    with ready(target):
        a = session.session(target, 100, 4, None, graphs=False)
        assert session.session(target, 300, None, None, graphs=False) is a  # any block size, within max_len
        b = session.session(target, 600, 4, None, graphs=False)
        assert b is not a and b.engine.max_len >= 600 and b.engine.block_size == 4
        assert session.session(target, 10, 8, None, graphs=False).engine.max_len >= 600


def test_prepare_builds_the_runner_and_round_that_decoding_uses():
    """`prepare` with the sampling settings of the decodes to come builds the runner they use (on a GPU its graphs
    and prefill widths are captured there, outside timed runs); greedy decodes share one runner whatever their
    top-p and top-k."""
    target = tiny_target("qwen3", seed=0)
    drafter = random_drafter(target, block_size=4)
    prompt = torch.tensor([[1, 2, 3]])
    with ready(target):
        sess = session.prepare(target, 64, 4, drafter, graphs=False, sampling=(1.0, 1.0, 0))
        (sampled,) = sess.runners.values()
        g = torch.Generator().manual_seed(0)
        generate(target, drafter, prompt, 8, temperature=1.0, generator=g, block_size=4, engine=True)
        assert list(sess.runners.values()) == [sampled] and sampled.probs is not None
        assert [r.runner for r in sess.rounds.values()] == [sampled]
        for top_p, top_k in [(1.0, 0), (0.9, 5)]:
            generate(target, drafter, prompt, 8, top_p=top_p, top_k=top_k, block_size=4, engine=True)
        assert len(sess.runners) == 2 and len(sess.rounds) == 2
    session.drop_session(target)


def test_engine_flag():
    moe = tiny_target("qwen3_5_moe", seed=0)
    drafter = random_drafter(moe, block_size=4)
    prompt = torch.tensor([[1, 2, 3]])
    with ready(moe):
        assert generate(moe, drafter, prompt, 3).backend == "plain"  # auto: unsupported (and on a CPU)
        with pytest.raises(ValueError, match="MoE"):
            generate(moe, drafter, prompt, 3, engine=True)
    target = tiny_target("qwen3", seed=0)
    with ready(target):
        assert generate(target, random_drafter(target, block_size=4), prompt, 3).backend == "plain"  # CPU: auto = plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CPU, capturing fails for certain")
def test_a_failed_capture_warns_and_runs_eagerly():
    target = tiny_target("qwen3", seed=0)
    drafter = random_drafter(target, block_size=4)
    prompt = torch.tensor([[1, 2, 3]])
    with ready(target):
        with pytest.warns(UserWarning, match="capture failed"):
            sess = session.prepare(target, 64, 4, drafter, graphs=True)
        assert "CUDA" in sess.capture_error and not sess.captured
        result = session.engine_decode(target, prompt, 8, drafter=drafter, block_size=4, graphs=True)
        assert result.backend == "engine" and result.tokens == reference_greedy(target, prompt, 8)
    session.drop_session(target)


def test_engine_choice():
    """auto (None) is the engine on a CUDA target it supports and the plain loop elsewhere; on (True) insists and
    says why it cannot; off (False) never uses it."""
    from flashdraft.speculative.generate import use_engine
    from flashdraft.target.tiny import random_tiny_model

    cpu = random_tiny_model("qwen3_5")
    assert use_engine(cpu, None) is False
    assert use_engine(cpu, True) is True  # the engine runs on the CPU too, eagerly
    assert use_engine(cpu, False) is False
    moe = random_tiny_model("qwen3_5_moe")
    assert use_engine(moe, None) is False
    with pytest.raises(ValueError, match="MoE"):
        use_engine(moe, True)
    if torch.cuda.is_available():
        assert use_engine(random_tiny_model("qwen3_5", device="cuda"), None) is True
    # The engine runs each model in its own dtype: a float32 drafter (training's master weights) beside a bf16
    # target takes the plain loop under auto, and on names both dtypes.
    bf16 = random_tiny_model("qwen3_5").to(torch.bfloat16)
    drafter = random_drafter(bf16, block_size=4).float()
    with pytest.raises(ValueError, match="drafter is torch.float32 and the target torch.bfloat16"):
        use_engine(bf16, True, drafter)
    assert use_engine(bf16, True, drafter.to(torch.bfloat16)) is True
    if torch.cuda.is_available():
        cuda = bf16.to("cuda")
        assert use_engine(cuda, None, drafter.float().to("cuda")) is False
        assert use_engine(cuda, None, drafter.to(torch.bfloat16)) is True
