"""Data errors that say where and what, and the report that counts what was skipped, truncated or dropped.

Every bad record either stops the run with a `DataError` naming the file, the line (JSONL) or row (Parquet), the
field and what is wrong, or — with `skip_bad` — is skipped and counted per reason in a `DataReport`. Nothing is
dropped without being counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flashdraft.io.redact import redact

# reason key -> what the summary table calls it
REASONS = {
    "malformed_json": "malformed JSON",
    "non_utf8": "not valid UTF-8",
    "not_an_object": "not a JSON object",
    "wrong_type": "wrong type",
    "missing_field": "missing field",
    "unknown_format": "format not recognised",
    "empty_messages": "empty conversation",
    "unknown_role": "unknown role",
    "no_assistant": "no assistant turn",
    "no_split_marker": "split marker not found",
    "empty_sample": "empty sample",
    "length_mismatch": "ids / mask lengths differ",
    "token_out_of_range": "token id out of range",
    "template_error": "chat template failed",
    "empty_file": "empty file",
    "unreadable_file": "unreadable file",
    "damaged_file": "damaged file (fails its checksum)",
}

_MAX_EXAMPLES = 3  # locations kept per skip reason, for the report


class DataError(ValueError):
    """A problem with the input data or its configuration; `str()` names file, line/row and field.

    `reason` is a key of `REASONS` (used to count skips). `skippable=False` marks errors that `--skip-bad` must not
    hide: a missing path, missing credentials, a tokenizer without a chat template.
    """

    def __init__(
        self,
        what: str,
        *,
        reason: str = "wrong_type",
        source: str | None = None,
        line: int | None = None,
        row: int | None = None,
        field: str | None = None,
        skippable: bool = True,
    ):
        self.what = redact(str(what))
        self.reason = reason
        self.source = redact(str(source)) if source is not None else None
        self.line = line
        self.row = row
        self.field = field
        self.skippable = skippable
        super().__init__(self.what)

    def at(self, source: str, *, line: int | None = None, row: int | None = None) -> DataError:
        """Fill in the location where it is not set yet (formats raise without knowing the file); return self."""
        if self.source is None:
            self.source = redact(str(source))
            self.line, self.row = line, row
        return self

    @property
    def location(self) -> str:
        if self.source is None:
            return ""
        if self.line is not None:
            return f"{self.source}:{self.line}"
        if self.row is not None:
            return f"{self.source} row {self.row}"
        return self.source

    def __str__(self) -> str:
        parts = [p for p in (self.location, f"field '{self.field}'" if self.field else "") if p]
        return ": ".join([*parts, self.what])


@dataclass
class DataReport:
    """Counts of a `prepare` run. `skip(err)` raises `err` unless `skip_bad` is set and the error is skippable."""

    skip_bad: bool = False
    files: int = 0
    records: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_loss: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, err: DataError) -> None:
        if not (self.skip_bad and err.skippable):
            raise err
        self.skipped[err.reason] += 1
        seen = self.examples.setdefault(err.reason, [])
        if len(seen) < _MAX_EXAMPLES:
            seen.append(str(err))

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "truncated": self.truncated,
            "dropped_overlong": self.dropped_overlong,
            "dropped_no_loss": self.dropped_no_loss,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
        }

    def table(self, title: str = "flashdraft prepare"):
        """A rich table of the counts, one row per skip reason (with the first locations seen)."""
        from rich.table import Table

        t = Table(title=title, show_header=True, header_style="bold")
        t.add_column("", no_wrap=True)
        t.add_column("count", justify="right", no_wrap=True)
        t.add_column("note", overflow="fold")
        t.add_row("files", f"{self.files:,}", "")
        t.add_row("records read", f"{self.records:,}", "")
        t.add_row("kept", f"{self.kept:,}", "")
        t.add_row("skipped", f"{self.num_skipped:,}", "" if self.skip_bad else "(--skip-bad off: none allowed)")
        for reason, n in sorted(self.skipped.items()):
            t.add_row(f"  {REASONS.get(reason, reason)}", f"{n:,}", "; ".join(self.examples.get(reason, [])))
        t.add_row("truncated (overlong)", f"{self.truncated:,}", "kept, cut to max_length")
        t.add_row("dropped (overlong)", f"{self.dropped_overlong:,}", "")
        t.add_row("dropped (no loss tokens)", f"{self.dropped_no_loss:,}", "")
        t.add_row("tokens", f"{self.tokens:,}", "")
        t.add_row("loss tokens", f"{self.loss_tokens:,}", "")
        return t
