"""MetricsLogger (metrics.jsonl, console line, progress bar, resume truncation, trackers), redact, the curve plot."""

import importlib.machinery
import importlib.util
import io
import json
import logging
import math
import sys
import types

import pytest
import torch
from rich.console import Console

from flashdraft.io.redact import is_secret_key, redact
from flashdraft.train.metrics import MetricsLogger, format_line, read_metrics
from flashdraft.train.plot import centered_mean, draw_training_curve, plot_training_curve, trend_reach
from tests.train.drawn import curve_pixels, height_trend

LOGGER = "flashdraft.train.metrics"


def console(width=200, terminal=False):
    return Console(file=io.StringIO(), width=width, force_terminal=terminal)


def row(step, **extra):
    return {"loss": 5.0 - step / 100, "sim_tau": 1.0 + step / 200, "acc": [0.4, 0.2], "tok_s": 12_345.6, **extra}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_are_written_and_flushed_at_once(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=30, console=console())
    metrics.log(10, {"loss": torch.tensor(3.25), "sim_tau": 1.5, "acc": torch.tensor([0.5, 0.25]), "lr": 6e-4})
    # Read while the logger is still open: a crash from here on loses nothing already logged.
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 10, "loss": 3.25, "sim_tau": 1.5, "acc": [0.5, 0.25], "lr": 6e-4}
    ]
    metrics.log(20, {"loss": float("nan"), "sim_tau": 1.6, "mfu": None, "time": 12.5})
    assert lines(tmp_path / "metrics.jsonl")[1] == {"step": 20, "loss": None, "sim_tau": 1.6, "mfu": None, "time": 12.5}
    metrics.close()
    metrics.close()
    out = metrics.console.file.getvalue()
    assert "step 10/30 | loss 3.250 | sim_tau 1.50 | acc@1 0.50 | lr 6.0e-4" in out
    assert "step 20/30 | loss nan | sim_tau 1.60" in out


def test_unserialisable_metric_names_its_key(tmp_path):
    with MetricsLogger(tmp_path, total_steps=1, console=console()) as metrics:
        with pytest.raises(TypeError, match="metric 'bad'"):
            metrics.log(1, {"bad": object()})


def test_format_line():
    metrics = {
        "loss": 3.2144,
        "sim_tau": 1.834,
        "acc": [0.412, 0.3],
        "tok_s": 12_345.0,
        "draft_tok_s": 45_210.0,
        "mfu": 0.3121,
        "mem_gib": 12.14,
        "lr": 5.8e-4,
        "block_tau": 2.0,
    }
    assert format_line(120, metrics, total_steps=600) == (
        "step 120/600 | loss 3.214 | sim_tau 1.83 | acc@1 0.41 | 12.3K tok/s | 45.2K draft tok/s | MFU 31.2% | "
        "mem 12.1 GiB | lr 5.8e-4"
    )
    assert format_line(7, {"loss": 2.0, "mem_gib": None, "tok_s": 950.0, "grad_norm": 0.5}) == (
        "step 7 | loss 2.000 | 950 tok/s | gnorm 0.50"
    )
    assert format_line(1, {"tok_s": 2.5e6, "lr": 0.0}) == "step 1 | 2.5M tok/s | lr 0.0e0"
    # A GPU of unknown peak: MFU shown as unknown, not left out (and never made up).
    assert format_line(3, {"tok_s": 950.0, "mfu": None}) == "step 3 | 950 tok/s | MFU –"


def test_piped_output_has_one_whole_line_per_log_step_and_no_bar(tmp_path):
    out = console(width=80)  # what rich assumes for a file or a pipe
    metrics = MetricsLogger(tmp_path, total_steps=20, console=out)
    wide = {**row(10), "draft_tok_s": 45_210.0, "mfu": 0.3121, "mem_gib": 12.14, "grad_norm": 0.5, "lr": 5.8e-4}
    with metrics.progress():
        metrics.advance(10)
        metrics.log(10, wide)
        metrics.advance(10)
        metrics.log(20, {**wide, "loss": 2.5})
    metrics.close()
    printed = out.file.getvalue().splitlines()
    assert printed == [
        format_line(10, {"step": 10, **wide}, total_steps=20),
        format_line(20, {"step": 20, **wide, "loss": 2.5}, total_steps=20),
    ]
    assert len(printed[0]) > 80  # so it would have wrapped


def test_the_bar_is_drawn_on_a_terminal(tmp_path):
    out = console(terminal=True)
    metrics = MetricsLogger(tmp_path, total_steps=10, console=out)
    with metrics.progress():
        metrics.advance(5)
        assert metrics._progress is not None
    metrics.close()
    assert "5/10" in out.file.getvalue()


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, total_steps=50, console=console()) as metrics:
        for step in (10, 20, 30, 40):
            metrics.log(step, row(step))
    uninterrupted = lines(tmp_path / "metrics.jsonl")[:3]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "loss": 1.')  # torn by a kill mid-write
    with MetricsLogger(tmp_path, total_steps=50, console=console(), resume_from_step=20) as metrics:
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20]
        metrics.log(30, row(30))
    assert lines(tmp_path / "metrics.jsonl") == uninterrupted


def test_a_fresh_run_starts_a_fresh_file(tmp_path, caplog):
    with MetricsLogger(tmp_path, total_steps=5, console=console()) as metrics:
        metrics.log(1, row(1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with MetricsLogger(tmp_path, total_steps=5, console=console()) as metrics:
            metrics.log(2, row(2))
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [2]
    assert "1 lines from an earlier run are replaced" in caplog.text


def test_disabled_logger_does_nothing(tmp_path):
    out = console()
    metrics = MetricsLogger(tmp_path / "run", total_steps=5, trackers=["tensorboard"], enabled=False, console=out)
    with metrics.progress():
        metrics.advance(3)
        metrics.log(1, row(1))
    metrics.close()
    assert not (tmp_path / "run").exists()
    assert out.file.getvalue() == ""


def test_progress_bar_tracks_steps_and_latest_values(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=10, console=console(terminal=True))
    with metrics.progress():
        metrics.advance(4)  # a resumed run's jump
        for step in (5, 6):
            metrics.advance()
            metrics.log(step, row(step))
        task = metrics._progress.tasks[0]
        assert task.completed == 6 and task.total == 10
        assert task.fields["stats"] == "loss 4.940 · sim_tau 1.03 · 12.3K tok/s"
    metrics.advance()  # outside the bar: ignored
    metrics.close()


# ---- trackers ---------------------------------------------------------------------------------------------------


def test_unknown_tracker_is_an_error_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'; valid: wandb, tensorboard, trackio"):
        MetricsLogger(tmp_path, total_steps=1, trackers=["mlflow"])
    with pytest.raises(ValueError, match="unknown tracker"):
        MetricsLogger(tmp_path, total_steps=1, trackers=["mlflow"], enabled=False)


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("tensorboard", "tensorboard"), ("trackio", "trackio")])
def test_a_named_tracker_that_is_not_installed_is_a_config_error(tmp_path, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # how Python marks a module that cannot be imported
    with pytest.raises(ValueError, match=f"log.trackers: '{name}' is not installed: pip install {package} "):
        MetricsLogger(tmp_path / "run", total_steps=2, trackers=[name], console=console())
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_tracker_that_fails_to_start_warns_and_training_continues(tmp_path, caplog, monkeypatch):
    fake = FakeWandb()
    fake.init = lambda **kwargs: (_ for _ in ()).throw(PermissionError("not logged in"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with MetricsLogger(tmp_path, total_steps=2, trackers=["wandb"], console=console()) as metrics:
            metrics.log(1, row(1))
    assert "tracker 'wandb' did not start (PermissionError: not logged in); training continues" in caplog.text
    assert len(lines(tmp_path / "metrics.jsonl")) == 1


class FakeWandb(types.ModuleType):
    """Records what a tracker is sent; `fail` makes log() raise, like a network error."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished, self.fail = [], [], 0, False

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(id=kwargs["id"] or "run123", log=self.log, finish=self.finish)

    def log(self, scalars, step):
        if self.fail:
            raise ConnectionError("offline")
        self.logged.append((step, scalars))

    def finish(self):
        self.finished += 1


def test_wandb_tracker_gets_redacted_config_flat_scalars_and_resumes_its_run(tmp_path, monkeypatch, caplog):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "drafters")
    config = {"train": {"lr": 6e-4}, "hub": {"hf_token": "hf_secret"}}
    with MetricsLogger(tmp_path, total_steps=4, trackers=["wandb"], config=config, console=console()) as metrics:
        metrics.log(1, {"loss": 2.0, "acc": [0.5, 0.25], "mfu": None, "note": "text"})
    assert fake.inits[0]["project"] == "drafters" and fake.inits[0]["id"] is None
    assert fake.inits[0]["config"] == {"train": {"lr": 6e-4}, "hub": {"hf_token": "<redacted>"}}
    assert fake.logged == [(1, {"loss": 2.0, "acc/1": 0.5, "acc/2": 0.25})]
    assert fake.finished == 1
    with MetricsLogger(tmp_path, total_steps=4, trackers=["wandb"], console=console(), resume_from_step=1) as metrics:
        fake.fail = True
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            metrics.log(2, {"loss": 1.5})
            metrics.log(3, {"loss": 1.0})
    assert (fake.inits[1]["id"], fake.inits[1]["resume"]) == ("run123", "allow")
    assert caplog.text.count("tracker wandb failed (ConnectionError: offline); continuing without it") == 1
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is optional, not installed")
def test_tensorboard_tracker_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(
        tmp_path, total_steps=2, trackers=["tensorboard"], console=console(), config={"hf_token": "hf_abc"}
    ) as metrics:
        metrics.log(1, row(1))
        metrics.log(2, row(2))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([4.99, 4.98])
    assert "acc/1" in events.Tags()["scalars"]


# ---- redact -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "aws_secret_access_key",
        "AWS_SECRET_ACCESS_KEY",
        "aws_access_key_id",
        "WANDB_API_KEY",
        "wandb_api_key",
        "apiKey",
        "hf_token",
        "HF_TOKEN",
        "hfToken",
        "token",
        "password",
        "db_password",
        "client_secret",
        "secret",
        "private_key",
        "github-token",
        "credentials",
        "key",
    ],
)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "max_tokens",
        "max_new_tokens",
        "num_tokens",
        "mask_token_id",
        "eos_token",
        "pad_token",
        "tokenizer",
        "keep_checkpoints",
        "linear_key_head_dim",
        "num_key_value_heads",
        "lr",
        "monkey",
        "token_budget_per_rank",
    ],
)
def test_ordinary_keys(key):
    assert not is_secret_key(key)


def test_redact_nested_config_without_touching_the_original():
    config = {
        "train": {"lr": 6e-4, "max_tokens": 4096},
        "drafter": {"mask_token_id": 248070},
        "data": {"train": ["s3://AKIAEXAMPLE:wJalrXUt@bucket/data.jsonl", "local.jsonl"]},
        "hub": {"hf_token": "hf_abcdef", "wandb_api_key": "0123", "unused_token": None},
        "runs": [{"aws_secret_access_key": "x"}],
    }
    safe = redact(config)
    assert safe["train"] == {"lr": 6e-4, "max_tokens": 4096}
    assert safe["drafter"] == {"mask_token_id": 248070}
    assert safe["data"]["train"] == ["s3://***@bucket/data.jsonl", "local.jsonl"]
    assert safe["hub"] == {"hf_token": "<redacted>", "wandb_api_key": "<redacted>", "unused_token": None}
    assert safe["runs"] == [{"aws_secret_access_key": "<redacted>"}]
    assert config["hub"]["hf_token"] == "hf_abcdef"
    assert "hf_abcdef" not in json.dumps(safe) and "wJalrXUt" not in json.dumps(safe)
    assert "AKIAEXAMPLE" not in json.dumps(safe)


# ---- plot -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [[10], list(range(10, 610, 10))])
def test_plot_training_curve_writes_a_png(tmp_path, steps):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=steps[-1], console=console()) as metrics:
        for step in steps:
            metrics.log(
                step, {"loss": 5.5 * math.exp(-step / 150) + 1.2, "sim_tau": 1 + 3 * (1 - math.exp(-step / 200))}
            )
    png = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "training_curve.png")
    assert png == tmp_path / "plots" / "training_curve.png"
    loss, tau = curve_pixels(png)
    assert loss.sum() > 20 and tau.sum() > 20  # both curves (a single step: both markers) are drawn
    if len(steps) > 1:  # the loss falls and tau rises: the loss ends lower on the image, tau higher
        loss_left, loss_right = height_trend(loss)
        tau_left, tau_right = height_trend(tau)
        assert loss_right > loss_left + 50 and tau_right < tau_left - 50, (loss_left, loss_right, tau_left, tau_right)
    assert not list(png.parent.glob(".*"))


def test_without_matplotlib_the_curve_is_skipped_with_one_line_saying_how_to_get_it(tmp_path, monkeypatch, caplog):
    with MetricsLogger(tmp_path, total_steps=10, console=console()) as metrics:
        metrics.log(10, row(10))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'flashdraft\[plot\]'"):
        plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert draw_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png") is None
    assert [r.getMessage() for r in caplog.records] == [
        "training curve not drawn: matplotlib is not installed (pip install 'flashdraft[plot]' to get it; every "
        f"value is in {tmp_path / 'metrics.jsonl'})"
    ]
    assert not (tmp_path / "curve.png").exists()


def test_the_curves_trend_is_a_centered_mean_of_the_log_windows():
    values = torch.randn(37, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).tolist()
    for reach in (1, 3):
        # Reference: each point's neighbourhood, clipped at the ends, averaged by torch.
        near = [values[max(0, i - reach) : min(len(values), i + reach + 1)] for i in range(len(values))]
        want = [torch.tensor(v, dtype=torch.float64).mean().item() for v in near]
        assert centered_mean(values, reach) == pytest.approx(want, rel=1e-12)
    assert [trend_reach(n) for n in (1, 9, 10, 19, 40, 60, 100)] == [0, 0, 2, 2, 2, 3, 5]


def test_plot_of_an_empty_log_says_so(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no logged step has a loss or sim_tau"):
        plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")


def test_plot_draws_the_final_measured_tau_and_ignores_a_nan(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=30, console=console()) as metrics:
        for step in (10, 20, 30):
            metrics.log(step, {"loss": 4.0 - step / 20, "sim_tau": 1 + step / 30})
    plain = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "a.png").read_bytes()
    nan = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "b.png", final_tau=float("nan")).read_bytes()
    final = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "c.png", final_tau=2.7).read_bytes()
    assert nan == plain and final != plain
