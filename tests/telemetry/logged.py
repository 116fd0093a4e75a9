"""What the telemetry tests log: a console to read back, a metrics row, the lines of a metrics.jsonl."""

import io
import json

from rich.console import Console


def console(width=200, terminal=False):
    return Console(file=io.StringIO(), width=width, force_terminal=terminal)


def row(step, **extra):
    return {"loss": 5.0 - step / 100, "sim_tau": 1.0 + step / 200, "acc": [0.4, 0.2], "tok_s": 12_345.6, **extra}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
