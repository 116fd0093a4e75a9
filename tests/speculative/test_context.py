"""Longer contexts for the context-length sweep: prompts left-padded with held-out text from other files."""

import json

import pytest
import torch

from flashdraft.data.errors import DataError
from flashdraft.speculative.context import ContextFiller
from flashdraft.speculative.prompts import Prompt

from .test_prompts import _tokenizer, _write


def test_pads_with_text_from_other_sources():
    filler = ContextFiller([("a.py", [1, 2, 3]), ("b.py", [4, 5]), (None, [6])])
    prompt = torch.tensor([[9, 9]])
    assert filler.pad(prompt, 6, source="c.py").tolist() == [[3, 4, 5, 6, 9, 9]]
    # The prompt's own file never pads it; short text repeats (distinct_tokens says after how many tokens).
    assert filler.pad(prompt, 6, source="a.py").tolist() == [[6, 4, 5, 6, 9, 9]]
    assert filler.pad(prompt, 7, source="a.py").tolist() == [[5, 6, 4, 5, 6, 9, 9]]
    assert filler.distinct_tokens("a.py") == 3 and filler.distinct_tokens() == 6
    assert filler.pad(prompt, 2).tolist() == [[9, 9]] and filler.pad(prompt, 1).tolist() == [[9, 9]]
    padded = filler.padded(Prompt(prompt, "code", 7, "b.py"), 5)
    assert padded.input_ids.tolist() == [[2, 3, 6, 9, 9]]
    assert (padded.category, padded.line, padded.source) == ("code", 7, "b.py")


def test_reads_a_jsonl_file_and_names_a_bad_line(tmp_path):
    good = _write(
        tmp_path / "text.jsonl",
        [json.dumps({"prompt": "the cat", "response": " sat", "source": "x.py"}), json.dumps({"prompt": "a dog"})],
    )
    filler = ContextFiller.from_jsonl(good, _tokenizer())
    assert [source for source, _ in filler.records] == ["x.py", None]
    assert filler.distinct_tokens("x.py") == len(_tokenizer()("a dog\n", add_special_tokens=False)["input_ids"])
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "the cat"}), json.dumps({"text": 3})])
    with pytest.raises(DataError, match=r"bad\.jsonl:2.*expected string fields prompt and/or response"):
        ContextFiller.from_jsonl(bad, _tokenizer())


def test_no_text_is_refused():
    with pytest.raises(ValueError, match="no text"):
        ContextFiller([("a.py", [])])
    with pytest.raises(ValueError, match="no text from sources other than 'a.py'"):
        ContextFiller([("a.py", [1])]).pad(torch.tensor([[1]]), 3, source="a.py")
