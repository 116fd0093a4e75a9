"""The record formats training data may come in, and the checks of a conversation every input path applies.

    FormatConfig(format="auto")   # auto | chat | sharegpt | text | tokenized: how records are read
    detect_format(record)         # the format of one record, from its keys
    check_messages(messages)      # roles and contents checked; DataError naming the field

How a record becomes token ids and a loss mask is encoder.py's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from flashdraft.data.errors import DataError

FORMATS = ("auto", "chat", "sharegpt", "text", "tokenized")
# accepted role names (ShareGPT's included) -> chat-template role
ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
}
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)


@dataclass(kw_only=True)
class FormatConfig:
    format: str = "auto"
    """auto (detect per record by its keys) | chat (`messages`) | sharegpt (`conversations`) | text (`text`, or
    `prompt` + `response`) | tokenized (`input_ids` + `loss_mask`)."""
    drop_thinking: bool = False
    """Remove thinking (`<think>...</think>` in assistant content, `reasoning_content`) before templating."""
    split_marker: str | None = None
    """For `text` records: the loss starts after the first occurrence of this marker (records without it are
    errors). None: loss on the whole text."""
    keep_split_marker: bool = True
    """Keep the split marker in the text (as part of the prompt, no loss); False removes it."""
    append_eos: bool = False
    """For text formats: append the tokenizer's EOS token (trained) to each sample."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {"enable_thinking": True}."""

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.split_marker == "":
            raise ValueError("split_marker: must be a non-empty string or None")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_format(record: dict) -> str:
    """The format of one record, from its keys."""
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "input_ids" in record:
        return "tokenized"
    if "text" in record or ("prompt" in record and "response" in record):
        return "text"
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise DataError(
        f"cannot tell the format from the keys ({keys}); expected messages, conversations, text, "
        "prompt + response, or input_ids + loss_mask",
        reason="unknown_format",
    )


def strip_thinking(text: str) -> str:
    """`text` without `<think>...</think>` blocks (an unopened `...</think>` prefix and an unclosed `<think>...`
    tail count as thinking too)."""
    head, sep, tail = text.partition("</think>")
    if sep and "<think>" not in head:
        text = tail.lstrip()
    text = _THINK_BLOCK.sub("", text)
    if "<think>" in text:
        text = text[: text.index("<think>")]
    return text


def check_messages(messages: Any, key: str = "messages") -> list[dict]:
    """The checks every input path applies to a conversation (training data, eval prompts, regeneration input):
    a non-empty list of objects, each with a known role (`role`, or ShareGPT's `from`; names as in ROLES) and text
    content (`content` or `value`: a string, or a list of {"type": "text"} parts; an assistant turn with
    `tool_calls` may have none). Returns the messages with chat-template roles and string contents, their other
    keys kept (None values, Parquet's absent struct keys, dropped). Raises DataError naming the field."""
    if not isinstance(messages, list):
        raise DataError(f"expected a list of messages, got {type(messages).__name__}", field=key)
    if not messages:
        raise DataError("empty conversation", reason="empty_messages", field=key)
    out = []
    for i, m in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"expected an object, got {type(m).__name__}", field=where)
        role_key = "role" if "role" in m else "from" if "from" in m else None
        if role_key is None:
            raise DataError("missing (expected 'role' or 'from')", reason="missing_field", field=f"{where}.role")
        role = m[role_key]
        if not isinstance(role, str):
            raise DataError(f"expected a string, got {type(role).__name__}", field=f"{where}.{role_key}")
        if role.lower() not in ROLES:
            raise DataError(
                f"unknown role {role!r} (expected one of {', '.join(ROLES)})",
                reason="unknown_role",
                field=f"{where}.{role_key}",
            )
        role = ROLES[role.lower()]
        content_key = "content" if "content" in m else "value" if "value" in m else None
        content = m.get(content_key) if content_key else None
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        elif content_key is None:
            raise DataError("missing (expected 'content' or 'value')", reason="missing_field", field=f"{where}.content")
        content = text_content(content, f"{where}.{content_key}")
        # Parquet structs give absent keys as None; drop them so templates see them as undefined.
        msg = {k: v for k, v in m.items() if k not in ("role", "from", "content", "value") and v is not None}
        msg["role"], msg["content"] = role, content
        if "reasoning_content" in msg and not isinstance(msg["reasoning_content"], str):
            raise DataError(
                f"expected a string, got {type(msg['reasoning_content']).__name__}", field=f"{where}.reasoning_content"
            )
        out.append(msg)
    return out


def text_content(value: Any, where: str) -> str:
    """A message content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        parts = [p.get("text") for p in value]
        if all(isinstance(t, str) for t in parts):
            return "".join(parts)
    raise DataError(f"expected a string, got {type(value).__name__}", field=where)
