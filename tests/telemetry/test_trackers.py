"""The trackers a run sends its scalars to (wandb, tensorboard, trackio), and `redact`, which keeps secrets out of
the config they receive."""

import importlib.machinery
import importlib.util
import json
import logging
import sys
import types

import pytest

from flashdraft.io.redact import is_secret_key, redact
from flashdraft.telemetry.metrics import MetricsLogger
from tests.telemetry.logged import console, lines, row

LOGGER = "flashdraft.telemetry.metrics"


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
