"""`flashdraft regenerate` on the bundled target: shapes of the output, batching, resume, bad records."""

import json

import pytest

from flashdraft import bundled
from flashdraft.data import DataError
from flashdraft.data.regenerate import SORTED_RUN_BATCHES, _length_sorted_runs, regenerate
from flashdraft.target import load_causal_lm


@pytest.fixture(scope="module")
def target_and_tokenizer():
    return load_causal_lm(bundled.BUNDLED, dtype="float32", device="cpu"), bundled.load_tokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": "def add(a, b):\n    return"},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "import os"},
            {"role": "assistant", "content": "old reply"},
        ]
    },
    {"conversations": [{"from": "human", "value": "for i in range("}, {"from": "gpt", "value": "x"}]},
    {"prompt": "class A:\n", "response": "old"},
    {"prompt": "while True:"},
]


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_output_shapes_and_batching(tmp_path, target_and_tokenizer):
    target, tok = target_and_tokenizer
    src = _write(tmp_path / "in.jsonl", ROWS)
    counts = regenerate(target, tok, [str(src)], tmp_path / "b.jsonl", max_new_tokens=6, batch_size=3, progress=False)
    assert counts.pop("seconds") >= 0
    assert counts == {"read": 5, "written": 5, "already_done": 0, "empty": 0}
    written = _read(tmp_path / "b.jsonl")
    # Written in batches of similar prompt length; each row keeps its record's index.
    assert [r["_index"] for r in written] != [0, 1, 2, 3, 4]
    rows = sorted(written, key=lambda r: r["_index"])
    assert [r["_index"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["prompt"] == ROWS[0]["prompt"] and isinstance(rows[0]["response"], str)
    chat = rows[1]["messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant"] and chat[-1]["content"] != "old reply"
    assert [m["role"] for m in rows[2]["messages"]] == ["user", "assistant"]
    assert rows[3]["response"] != "old" and rows[3]["source"].endswith("in.jsonl:4")
    # Greedy and left-padded batches give what one-at-a-time generation gives.
    regenerate(target, tok, [str(src)], tmp_path / "one.jsonl", max_new_tokens=6, batch_size=1, progress=False)
    assert sorted(_read(tmp_path / "one.jsonl"), key=lambda r: r["_index"]) == rows


def test_a_regeneration_cut_short_keeps_a_sample_of_the_file_not_its_shortest_prompts():
    """Lengths are sorted within runs of batches only: the first N rows written are the file's first N records."""
    import random
    from types import SimpleNamespace

    rng = random.Random(0)
    batch, count = 3, 5 * SORTED_RUN_BATCHES * 3 + 7  # five whole runs and a partial one
    jobs = [SimpleNamespace(index=i) for i in range(count)]
    texts = {i: "x" * rng.randrange(1, 500) for i in range(count)}
    ordered = _length_sorted_runs(jobs, texts, batch)
    run = SORTED_RUN_BATCHES * batch
    assert sorted(j.index for j in ordered) == list(range(count))
    for start in range(0, count, run):
        chunk = ordered[start : start + run]
        assert {j.index for j in chunk} == set(range(start, min(start + run, count)))
        lengths = [len(texts[j.index]) for j in chunk]
        assert lengths == sorted(lengths)
    # A global sort would have put the shortest prompts of the whole file first.
    assert [j.index for j in ordered[:run]] != [j.index for j in sorted(jobs, key=lambda j: len(texts[j.index]))[:run]]


def test_resume_skips_done_records_and_drops_a_torn_line(tmp_path, target_and_tokenizer):
    target, tok = target_and_tokenizer
    src = _write(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    regenerate(target, tok, [str(src)], out, max_new_tokens=4, batch_size=2, limit=3, progress=False)
    with open(out, "a") as fh:
        fh.write('{"prompt": "half a li')  # killed mid-write
    counts = regenerate(target, tok, [str(src)], out, max_new_tokens=4, batch_size=2, progress=False)
    assert counts.pop("seconds") >= 0
    assert counts == {"read": 5, "written": 2, "already_done": 3, "empty": 0}
    assert sorted(r["_index"] for r in _read(out)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user turn"),
        ({"messages": []}, "field 'messages': empty conversation"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "field 'messages\\[0\\].role': unknown role 'robot'"),
        ({"conversations": [{"from": "human", "value": 3}]}, "field 'conversations\\[0\\].value': expected a string"),
        ({"prompt": ["not", "text"]}, "field 'prompt': expected a string, got list"),
        ({"text": "no prompt"}, "no prompt to continue"),
        ({"other": 1}, "expected 'messages'"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, target_and_tokenizer, row, message):
    target, tok = target_and_tokenizer
    src = _write(tmp_path / "in.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=rf"in.jsonl:2: .*{message}"):
        regenerate(target, tok, [str(src)], tmp_path / "o.jsonl", max_new_tokens=2, progress=False)


# ---- serving-engine backends -------------------------------------------------------------------------------------


def _fake_vllm(monkeypatch, calls):
    """A stand-in `vllm` module with the offline API flashdraft uses: LLM(model, ...).generate(texts, params)."""
    import sys
    import types

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs))

        def generate(self, texts, params, use_tqdm=True):
            calls.append(("generate", list(texts), params.kwargs))
            completion = types.SimpleNamespace
            return [completion(outputs=[completion(text=f"<reply to {len(t)} chars>")]) for t in texts]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    module.__spec__ = types.SimpleNamespace(name="vllm")
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_vllm_backend_is_driven_through_its_offline_api(tmp_path, monkeypatch):
    import torch

    from flashdraft.data.regenerate import VLLMGenerator, choose_backend

    calls = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "vllm" else None)
    assert choose_backend("auto", torch.device("cuda")) == "vllm"
    assert choose_backend("auto", torch.device("cpu")) == "hf"  # serving engines are GPU programs
    src = _write(tmp_path / "in.jsonl", ROWS[:1] + ROWS[3:])
    generator = VLLMGenerator("/models/target", trust_remote_code=False, seed=7)
    counts = regenerate(
        generator,
        bundled.load_tokenizer(),
        [str(src)],
        tmp_path / "o.jsonl",
        temperature=0.7,
        max_new_tokens=5,
        batch_size=2,
        progress=False,
    )
    assert counts["written"] == 3
    assert calls[0] == ("init", {"model": "/models/target", "trust_remote_code": False, "seed": 7})
    assert [c[1] for c in calls[1:]] == [[ROWS[0]["prompt"], ROWS[3]["prompt"]], [ROWS[4]["prompt"]]]
    assert calls[1][2] == {"temperature": 0.7, "max_tokens": 5, "seed": 0} and calls[2][2]["seed"] == 2
    rows = _read(tmp_path / "o.jsonl")
    assert [r["response"] for r in rows] == [f"<reply to {len(ROWS[i]['prompt'])} chars>" for i in (0, 3, 4)]


def test_empty_replies_are_counted_not_written(tmp_path):
    """Training refuses an empty response, so a prompt the target answers with nothing (it stopped at once) is
    counted and left out; a resumed run asks for it again."""
    src = _write(tmp_path / "in.jsonl", ROWS[:1] + ROWS[3:])
    replies = iter([["", "b"], ["c"], ["again"]])
    generate = lambda texts, *rest: next(replies)[: len(texts)]  # noqa: E731
    out = tmp_path / "o.jsonl"
    counts = regenerate(generate, bundled.load_tokenizer(), [str(src)], out, batch_size=2, progress=False)
    assert (counts["written"], counts["empty"]) == (2, 1)
    assert sorted(r["response"] for r in _read(out)) == ["b", "c"]
    counts = regenerate(generate, bundled.load_tokenizer(), [str(src)], out, batch_size=2, progress=False)
    assert (counts["already_done"], counts["written"], counts["empty"]) == (2, 1, 0)
    assert sorted(r["response"] for r in _read(out)) == ["again", "b", "c"]


def test_missing_engine_is_a_clear_error(monkeypatch):
    import torch

    from flashdraft.data.regenerate import choose_backend

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="--backend sglang: sglang is not installed"):
        choose_backend("sglang", torch.device("cuda"))
    assert choose_backend("auto", torch.device("cuda")) == "hf"
