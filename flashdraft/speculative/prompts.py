"""Prompts to decode: a JSON-lines file read through the checks training data gets, tokenized for the target.

    prompts = load_prompts("prompts.jsonl", tokenizer, limit=64)

Each line is `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the tokenizer's chat template,
generation prompt added) or `{"prompt": "raw text"}`, with an optional `"category"` and `"source"` (the file the
text came from). `flashdraft eval` and the measured τ of training read their prompts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.data.errors import DataError
from flashdraft.data.formats import check_messages
from flashdraft.data.sources import iter_records, resolve_sources


@dataclass
class Prompt:
    input_ids: torch.Tensor
    category: str
    line: int
    # The file the prompt's text came from, when the record says (`"source"`): padding for longer contexts
    # (flashdraft.speculative.context) then leaves that file out.
    source: str | None = None


def load_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[Prompt]:
    """Read and tokenize a prompts JSONL file, through the checks training data gets (flashdraft.data.sources and
    formats.check_messages: UTF-8, JSON objects, known roles, text contents); a bad line raises DataError
    naming `path:line` and the field."""
    if "://" not in str(path) and not Path(path).is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts: list[Prompt] = []
    try:
        for record in iter_records(resolve_sources([str(path)])):
            if limit is not None and len(prompts) >= limit:
                break
            try:
                data = record.data
                source = data.get("source") if isinstance(data.get("source"), str) else None
                prompt = Prompt(_tokenize(data, tokenizer), _category(data), record.line or 0, source)
            except DataError as err:
                raise err.at(record.source, line=record.line, row=record.row) from None
            prompts.append(prompt)
    except DataError as err:
        if err.reason != "empty_file":
            raise
    if not prompts:
        raise DataError(
            "no prompts (expected JSON lines with 'messages' or 'prompt')",
            reason="empty_file",
            source=str(path),
            skippable=False,
        )
    return prompts


def _category(record: dict) -> str:
    category = record.get("category", "all")
    if not isinstance(category, str) or not category:
        raise DataError(f"'category' must be a non-empty string, got {category!r}")
    return category


def _tokenize(record: dict, tokenizer) -> torch.Tensor:
    if "messages" in record:
        messages = check_messages(record["messages"], "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("'messages' needs a chat template, and the target's tokenizer has none")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise DataError(f"'prompt' must be a string, got {type(record['prompt']).__name__}")
        ids = tokenizer(record["prompt"])["input_ids"]
    else:
        raise DataError(f"expected a 'messages' or a 'prompt' field, got keys {sorted(record)}", reason="missing_field")
    if not ids:
        raise DataError("the prompt tokenizes to nothing", reason="empty_sample")
    return torch.tensor([ids], dtype=torch.long)
