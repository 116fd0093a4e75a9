"""Where the fast-path backends report which implementation each call used, while a probe listens.

A probe (probe.py) activates a `CallLog` and tells it, through forward pre-hooks, which layer is running;
backends call `note(op, impl, reason)`. Outside a probe `note` is one context-variable read.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class CallLog:
    layer: int | None = None
    # layer index -> op name -> list of (implementation, reason-if-fallback) in call order
    calls: dict[int, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    # (layer, op, impl) of the most recent call: where a crash happened
    last: tuple[int, str, str] | None = None

    def add(self, op: str, impl: str, reason: str) -> None:
        if self.layer is None:
            return
        self.calls.setdefault(self.layer, {}).setdefault(op, []).append((impl, reason))
        self.last = (self.layer, op, impl)


_ACTIVE: ContextVar[CallLog | None] = ContextVar("flashdraft_fastpath_calllog", default=None)


def note(op: str, impl: str, reason: str = "") -> None:
    log = _ACTIVE.get()
    if log is not None:
        log.add(op, impl, reason)


@contextlib.contextmanager
def listening():
    log = CallLog()
    token = _ACTIVE.set(log)
    try:
        yield log
    finally:
        _ACTIVE.reset(token)
