"""Credentials kept out of messages, logs, meta.json and trackers: one `redact` for text and for configs.

Text loses URL credentials (`scheme://user:secret@host`, and a bare `key:secret@bucket` inside a library's message)
and the values of the AWS secrets in the environment. A config (nested mappings and lists) loses the values of
credential-named keys (`is_secret_key`) and, in every string, the same as text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

# Environment variables whose values must never reach a message, a log line or meta.json.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_BARE_USERINFO = re.compile(r"[^\s/@\"':]+:[^\s/@\"']+@")  # "key:secret@bucket" inside a library's message

# Word sequences that make a key secret wherever they appear in it, and last words that do at the end
# (hf_token, wandb_api_key) but not in the middle (mask_token_id, linear_key_head_dim) or plural (max_tokens).
_SECRET_WORDS = (
    "secret",
    "password",
    "passwd",
    "credential",
    "credentials",
    "api_key",
    "apikey",
    "access_key",
    "private_key",
    "auth_token",
)
_SECRET_LAST_WORDS = ("key", "token")
# Tokenizer special tokens are strings like "<|im_end|>", not credentials.
_NOT_SECRET = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")


def is_secret_key(key: str) -> bool:
    """Whether a config key names a credential, by whole words: aws_secret_access_key, WANDB_API_KEY, hfToken."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", words) if w]
    if not words:
        return False
    joined = "_" + "_".join(words) + "_"
    if joined.strip("_") in _NOT_SECRET:
        return False
    return words[-1] in _SECRET_LAST_WORDS or any(f"_{w}_" in joined for w in _SECRET_WORDS)


def redact(value: Any) -> Any:
    """A copy of `value` without credentials: a string as text (see above), a mapping or list item by item, with
    credential-named keys' values replaced by REDACTED; other values as they are."""
    if isinstance(value, Mapping):
        return {
            key: (REDACTED if item is not None else None) if is_secret_key(key) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if not isinstance(value, str):
        return value
    text = _BARE_USERINFO.sub("***@", _USERINFO.sub(r"\g<scheme>***@", value))
    for name in _SECRET_ENV:
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, f"<{name}>")
    return text
