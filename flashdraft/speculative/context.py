"""Longer contexts for `flashdraft eval --context-lengths`: prompts left-padded with real held-out text.

    filler = ContextFiller.from_jsonl(bundled.eval_prompts(), tokenizer)
    long_prompt = filler.padded(prompt, 8192)          # the prompt, after the last 8192 - P tokens of the text

The text is the package's held-out evaluation data (code from standard-library files neither the bundled target nor
its drafter saw), so a longer context holds realistic text rather than noise or repeats of the prompt. Records from
the prompt's own source file are left out, so the padding never contains the prompt's continuation. When a length
needs more text than there is, the text repeats (`distinct_tokens` says from where); repeated text favours prompt
lookup, and the report says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.data.errors import DataError
from flashdraft.data.sources import iter_records, resolve_sources
from flashdraft.speculative.prompts import Prompt

# The text fields of a record that go into the padding, in this order.
TEXT_FIELDS = ("prompt", "response")


class ContextFiller:
    """Token ids of held-out text records, each with the source file it came from (or None)."""

    def __init__(self, records: list[tuple[str | None, list[int]]]):
        self.records = [(source, ids) for source, ids in records if ids]
        if not self.records:
            raise ValueError("the context filler has no text")

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer) -> ContextFiller:
        """The records of a JSON-lines file with a "prompt" (and optionally a "response") string and an optional
        "source"; a bad line raises DataError naming `path:line`."""
        records = []
        for record in iter_records(resolve_sources([str(path)])):
            data = record.data
            texts = [data[k] for k in TEXT_FIELDS if k in data]
            if not texts or not all(isinstance(t, str) for t in texts):
                error = DataError(f"expected string fields {' and/or '.join(TEXT_FIELDS)}, got keys {sorted(data)}")
                raise error.at(record.source, line=record.line, row=record.row)
            source = data.get("source") if isinstance(data.get("source"), str) else None
            records.append((source, tokenizer("".join(texts) + "\n", add_special_tokens=False)["input_ids"]))
        return cls(records)

    def _stream(self, source: str | None) -> list[int]:
        ids = [token for s, record in self.records if source is None or s != source for token in record]
        if not ids:
            raise ValueError(f"the context filler has no text from sources other than {source!r}")
        return ids

    def distinct_tokens(self, source: str | None = None) -> int:
        """How many tokens of padding come before the text repeats (for a prompt from `source`)."""
        return len(self._stream(source))

    def pad(self, input_ids: torch.Tensor, length: int, source: str | None = None) -> torch.Tensor:
        """`(1, T)` prompt ids -> `(1, max(T, length))`: the last `length - T` tokens of the text, then the prompt."""
        need = length - input_ids.shape[-1]
        if need <= 0:
            return input_ids
        stream = self._stream(source)
        stream = stream * -(-need // len(stream))
        pad = torch.tensor(stream[len(stream) - need :], dtype=input_ids.dtype).view(1, -1)
        return torch.cat([pad, input_ids.view(1, -1).cpu()], dim=1)

    def padded(self, prompt: Prompt, length: int) -> Prompt:
        """`prompt` left-padded to `length` tokens with text from files other than its own."""
        return Prompt(self.pad(prompt.input_ids, length, prompt.source), prompt.category, prompt.line, prompt.source)
