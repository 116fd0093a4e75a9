"""Records to token ids + loss mask: chat, ShareGPT, raw text, pre-tokenised (the formats: formats.py).

    enc = Encoder(tokenizer, FormatConfig(format="auto", drop_thinking=False))
    sample = enc.encode({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
    sample.input_ids  # int32 [T]
    sample.loss_mask  # uint8 [T]: 1 on tokens the drafter learns to produce (assistant turns / responses)

The mask is *not* shifted: `loss_mask[t] == 1` means token t is a response token (a training label).

Chat records are rendered with the tokenizer's own chat template, so the drafter trains on exactly the text the
target sees when serving. The assistant spans are found in the rendered text without template-specific markers:

- the end of an assistant turn's content: render the conversation again with that message's content replaced by a
  private-use character; the text before it and after it is identical to the real rendering, which locates the
  content even when the template rewrites it (Qwen3-style templates strip the reasoning of earlier turns, move
  `<think>` blocks, or add an empty think block to the last turn). The special token right after the content
  (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...) is trained too: the drafter must learn to end a turn.
- the start: the end of `messages[:i]` rendered with `add_generation_prompt=True` when that is a prefix of the
  full rendering (so a thinking block the template puts after the generation prompt is trained), else the content
  start.

Character spans are mapped to tokens with the fast tokenizer's offsets: a token is a loss token when its characters
overlap an assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flashdraft.data.errors import DataError
from flashdraft.data.formats import FormatConfig, check_messages, detect_format, strip_thinking, text_content

_DUMMIES = tuple(map(chr, range(0xE000, 0xE100)))  # private-use characters that stand in for a message's content


@dataclass
class Sample:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Rendered:
    """Text to tokenise and the character spans that carry the loss."""

    text: str
    spans: list[tuple[int, int]]
    add_special_tokens: bool


class Encoder:
    """Turns records into `Sample`s with one tokenizer and one `FormatConfig`."""

    def __init__(self, tokenizer, config: FormatConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config or FormatConfig()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(
                f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer: flashdraft needs the "
                "offsets of a `tokenizers`-backed one (tokenizer.json)",
                reason="template_error",
                skippable=False,
            )
        self._backend = backend
        self.vocab_size = len(tokenizer)
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                specials.add(str(tok))
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)
        template = tokenizer.chat_template
        self._template_reads_reasoning = "reasoning_content" in str(template or "")
        if self.config.append_eos and not tokenizer.eos_token:
            raise ValueError("append_eos: the tokenizer has no eos_token")

    # ---- public

    def encode(self, record: dict) -> Sample:
        """One record -> Sample; raises DataError (without location) when the record is bad."""
        out = self.encode_batch([record])[0]
        if isinstance(out, DataError):
            raise out
        return out

    def encode_batch(self, records: list[dict]) -> list[Sample | DataError]:
        """Records -> Samples, tokenised in one batch; a bad record gives its DataError in its place (non-skippable
        errors, e.g. a tokenizer without a chat template, are raised)."""
        results: list[Any] = []
        for rec in records:
            try:
                results.append(self.render(rec))
            except DataError as err:
                if not err.skippable:
                    raise
                results.append(err)
        for add_special in (False, True):
            todo = [i for i, r in enumerate(results) if isinstance(r, Rendered) and r.add_special_tokens == add_special]
            if not todo:
                continue
            encodings = self._backend.encode_batch([results[i].text for i in todo], add_special_tokens=add_special)
            for i, enc in zip(todo, encodings, strict=True):
                results[i] = _to_sample(enc.ids, enc.offsets, results[i].spans)
        return results

    def check_chat_template(self) -> None:
        """Raise a (non-skippable) DataError when the tokenizer has no chat template."""
        if not self.tokenizer.chat_template:
            raise DataError(
                f"tokenizer '{self.tokenizer.name_or_path}' has no chat template, so chat records cannot "
                "be rendered: use --format text for raw text, or give a tokenizer with a chat_template "
                "(chat_template.jinja or tokenizer_config.json)",
                reason="template_error",
                skippable=False,
            )

    def render(self, record: dict) -> Rendered | Sample:
        fmt = self.config.format
        if fmt == "auto":
            fmt = detect_format(record)
        if fmt in ("chat", "sharegpt"):
            return self._render_chat(record, fmt)
        if fmt == "text":
            return self._render_text(record)
        return self._tokenized(record)

    # ---- chat

    def _render_chat(self, record: dict, fmt: str) -> Rendered:
        keys = ("messages", "conversations") if fmt == "chat" else ("conversations", "messages")
        key = next((k for k in keys if k in record), None)
        if key is None:
            raise DataError(f"missing (format {fmt})", reason="missing_field", field=keys[0])
        messages = self._normalize(record[key], key, record.get("system"))
        self.check_chat_template()
        full = self._apply(messages, False)
        spans = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            p, q = self._content_span(messages, i, full)
            start = p
            head = self._apply(messages[:i], True, quiet=True) if i > 0 else None
            if head is not None and len(head) <= p and full.startswith(head):
                start = len(head)
            end = q + next((len(s) for s in self._specials if full.startswith(s, q)), 0)
            spans.append((start, end))
        return Rendered(full, spans, add_special_tokens=False)

    def _normalize(self, messages: Any, key: str, system: Any = None) -> list[dict]:
        out = check_messages(messages, key)
        for msg in out:
            if msg["role"] == "assistant":
                self._thinking(msg)
        if isinstance(system, str) and out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": system})
        if not any(m["role"] == "assistant" for m in out):
            raise DataError("no assistant turn: nothing to train on", reason="no_assistant", field=key)
        return out

    def _thinking(self, msg: dict) -> None:
        if self.config.drop_thinking:
            msg.pop("reasoning_content", None)
            msg["content"] = strip_thinking(msg["content"])
        elif msg.get("reasoning_content") and not self._template_reads_reasoning:
            # The template would silently drop the field; put the thinking where the model writes it.
            msg["content"] = f"<think>\n{msg.pop('reasoning_content')}\n</think>\n\n{msg['content']}"

    def _apply(self, messages: list[dict], generation_prompt: bool, quiet: bool = False) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **self.config.template_kwargs
            )
        except Exception as exc:
            if quiet:
                return None
            raise DataError(f"the chat template failed: {type(exc).__name__}: {exc}", reason="template_error") from None

    def _content_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int]:
        """Character span of message i's content in `full` (see the module docstring)."""
        dummy = next((d for d in _DUMMIES if d not in full), None)
        if dummy is None:
            raise DataError(
                "the conversation uses every private-use character flashdraft could stand in for its content",
                reason="template_error",
            )
        alt = [*messages[:i], {**messages[i], "content": dummy}, *messages[i + 1 :]]
        other = self._apply(alt, False)
        p = other.find(dummy)
        tail = len(other) - p - len(dummy)
        if p >= 0 and other.count(dummy) == 1 and full.startswith(other[:p]) and full.endswith(other[p + len(dummy) :]):
            return p, max(p, len(full) - tail)
        p = _common_prefix(full, other)
        return p, max(p, len(full) - _common_suffix(full, other, min(len(full), len(other)) - p))

    # ---- text

    def _render_text(self, record: dict) -> Rendered:
        cfg, eos = self.config, self.tokenizer.eos_token if self.config.append_eos else ""
        if "prompt" in record and "response" in record and "text" not in record:
            prompt = text_content(record["prompt"], "prompt")
            response = text_content(record["response"], "response")
            text, start = prompt + response, len(prompt)
            if not response:
                raise DataError("empty response", reason="empty_sample", field="response")
        elif "text" in record:
            text = text_content(record["text"], "text")
            start = 0
            if cfg.split_marker is not None:
                at = text.find(cfg.split_marker)
                if at < 0:
                    raise DataError(
                        f"split marker {cfg.split_marker!r} not found", reason="no_split_marker", field="text"
                    )
                if cfg.keep_split_marker:
                    start = at + len(cfg.split_marker)
                else:
                    text, start = text[:at] + text[at + len(cfg.split_marker) :], at
        else:
            raise DataError("missing (expected 'text' or 'prompt' + 'response')", reason="missing_field", field="text")
        if not text:
            raise DataError("empty text", reason="empty_sample", field="text")
        text += eos
        return Rendered(text, [(start, len(text))], add_special_tokens=True)

    # ---- pre-tokenised

    def _tokenized(self, record: dict) -> Sample:
        for key in ("input_ids", "loss_mask"):
            if key not in record:
                raise DataError(
                    "missing (format tokenized needs input_ids and loss_mask)", reason="missing_field", field=key
                )
        ids = _int_array(record["input_ids"], "input_ids", allow_bool=False)
        mask = _int_array(record["loss_mask"], "loss_mask", allow_bool=True)
        if len(ids) != len(mask):
            raise DataError(
                f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}",
                reason="length_mismatch",
                field="loss_mask",
            )
        if len(ids) == 0:
            raise DataError("no tokens", reason="empty_sample", field="input_ids")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise DataError(
                f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                f"[0, {self.vocab_size})",
                reason="token_out_of_range",
                field="input_ids",
            )
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            raise DataError(
                f"values must be 0 or 1, got {int(mask[bad[0]])} at position {int(bad[0])}", field="loss_mask"
            )
        return Sample(ids.astype(np.int32), mask.astype(np.uint8))


def _int_array(value: Any, where: str, allow_bool: bool) -> np.ndarray:
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise DataError(f"expected a list of integers, got {type(value).__name__}", field=where)
    kinds = "iub" if allow_bool else "iu"
    if any(isinstance(v, bool) and not allow_bool for v in value):
        raise DataError("expected integers, got booleans", field=where)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
        raise DataError("expected a flat list of integers", field=where)
    return arr.astype(np.int64)


def _to_sample(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> Sample:
    input_ids = np.asarray(ids, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    if len(ids) and spans:
        off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        s, e = off[:, 0], off[:, 1]
        for a, b in spans:
            mask |= ((s < b) & (e > a)) | ((s == e) & (s >= a) & (s < b))
    return Sample(input_ids, mask.astype(np.uint8))


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality: C-speed comparisons, O(n log n)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, max(limit, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo
