"""Offline features: `flashdraft features` writes what the online trainer would capture, training on them gives the
online losses, 2 ranks write the same features as 1, s3:// works, and wrong or missing features are clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.data.features import FeatureStore, write_features
from flashdraft.train import loop, setup
from flashdraft.train.setup import load_inputs
from tests import SHIPPED_DRAFTER
from tests.data.conftest import moto_server, no_aws, s3  # noqa: F401 (the moto S3 fixtures of tests/data)

ROOT = Path(__file__).resolve().parents[2]
# batch_size 1: the online trainer then captures each sequence alone, exactly as the features command does.
RUN = [
    *SHIPPED_DRAFTER,
    "train.max_steps=3",
    "log.every=1",
    "log.checkpoint_every=3",
    "data.eval_prompts=null",
    "train.batch_size=1",
    "train.device=cpu",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The first 24 records of the bundled data: the CPU captures one sequence at a time."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(bundled.ASSETS.joinpath("train.jsonl").read_text().splitlines(keepends=True)[:24]))
    return path


def _cfg(data: Path, out: Path, *extra: str):
    return load_config(bundled.ASSETS / "train.yaml", [*RUN, f"data.train=[{data}]", f"log.out={out}", *extra])


def _write(cfg, out: str):
    """The features of `cfg`'s training data, its target and data built as `flashdraft features` builds them."""
    _, _, target, data, _ = setup.load_inputs(cfg, Path(cfg.log.out), None, offline=False)
    return write_features(target, data, out, s3=cfg.s3, sharded=cfg.target.shard, target_path=cfg.target.path)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def features(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    result = _write(_cfg(data, root / "run"), str(root / "features"))
    return root, result


def test_features_are_what_the_target_captures(features, data):
    root, result = features
    cfg = _cfg(data, root / "run")
    _, _, target, dataset, _ = load_inputs(cfg, root / "run", None, offline=False)
    store = FeatureStore(str(root / "features"))
    index = json.loads((root / "features" / "features.json").read_text())
    assert result.samples == len(dataset) == index["num_samples"] and index["target_layer_ids"] == [
        1,
        2,
        3,
        4,
        5,
    ]  # the shipped drafter's
    for i in (0, 7, len(dataset) - 1):
        ids = torch.tensor(dataset[i][0], dtype=torch.long)[None]
        expected = target.capture(ids, torch.ones_like(ids))[0]
        got = store.sample(i)
        assert got.dtype == expected.dtype and torch.equal(got, expected), i
    # Only the captured layers: 5 layers x hidden 256 per token.
    assert store.sample(0).shape == (len(dataset[0][0]), 5 * 256)
    head = store.head_target()
    assert torch.equal(head.lm_head_weight, target.lm_head_weight)
    assert torch.equal(head.embed(torch.arange(5)[None]), target.embed(torch.arange(5)[None]))


def test_offline_training_gives_the_online_losses(features, data, tmp_path):
    root, _ = features
    online, offline = tmp_path / "online", tmp_path / "offline"
    loop.train(_cfg(data, online))
    loop.train(_cfg(data, offline, f"data.features={root / 'features'}"))
    assert _losses(offline) == _losses(online)  # the same numbers in the same order: equal, not just close
    a = (online / "checkpoints" / "step_00000003" / "drafter" / "model.safetensors").read_bytes()
    b = (offline / "checkpoints" / "step_00000003" / "drafter" / "model.safetensors").read_bytes()
    assert a == b


DSPARK = ["drafter.family=dspark", "drafter.dspark.markov_rank=16"]


def test_dspark_trains_offline_on_features_with_the_final_hidden_states(features, data, tmp_path):
    """DSpark's loss reads the target's final hidden states: its features store them after the captured layers
    (6 of 5 layers' width), and training on them gives the online losses; a store without them is refused before
    training, naming itself."""
    root, _ = features
    store_dir = tmp_path / "features"
    _write(_cfg(data, tmp_path / "write", *DSPARK), str(store_dir))
    store = FeatureStore(str(store_dir))
    assert store.final_hidden and store.sample(0).shape[-1] == 6 * 256
    online, offline = tmp_path / "online", tmp_path / "offline"
    loop.train(_cfg(data, online, *DSPARK))
    loop.train(_cfg(data, offline, *DSPARK, f"data.features={store_dir}"))
    assert _losses(offline) == _losses(online)
    with pytest.raises(ValueError, match="holds no final hidden states"):
        loop.train(_cfg(data, tmp_path / "refused", *DSPARK, f"data.features={root / 'features'}"))


def test_two_ranks_write_the_features_of_one(features, data, tmp_path):
    root, _ = features
    out = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "flashdraft",
        "features",
        "--nproc",
        "2",
        "--out",
        str(out),
        *RUN,
        f"data.train=[{data}]",
        f"log.out={tmp_path / 'run'}",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("done:") == 1
    one, two = FeatureStore(str(root / "features")), FeatureStore(str(out))
    assert {Path(f).name.split("-")[1] for f in two.index["files"]} == {"00000", "00001"}  # each rank wrote its own
    for i in range(one.index["num_samples"]):
        assert torch.equal(one.sample(i), two.sample(i)), i


def _env():
    import os

    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def test_features_on_s3(features, data, s3, tmp_path):  # noqa: F811 (the fixture)
    client, bucket, endpoint = s3
    root, _ = features
    url = f"s3://{bucket}/feat/run1"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        _write(_cfg(data, tmp_path / "run"), url)
        keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
        assert {"feat/run1/features.json", "feat/run1/head.safetensors", "feat/run1/config.json"} <= keys
        remote, local = FeatureStore(url), FeatureStore(str(root / "features"))
        for i in (0, 3, remote.index["num_samples"] - 1):
            assert torch.equal(remote.sample(i), local.sample(i))
        batch = remote.batch([2, 5], 400)  # longer than any sample (data.max_length 320): padded
        assert batch.shape == (2, 400, local.width)
        assert (
            torch.equal(batch[1, : len(local.sample(5))], local.sample(5))
            and not batch[1, len(local.sample(5)) :].any()
        )


def test_missing_features_are_a_clear_error(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"data.features = .*nope: no features.json there .*flashdraft features"
    ):
        FeatureStore(str(tmp_path / "nope"))


def test_features_of_other_data_are_refused(features, data, tmp_path):
    root, _ = features
    cfg = _cfg(data, tmp_path / "run", "data.max_length=128", f"data.features={root / 'features'}")
    with pytest.raises(ValueError, match="captured from other training data"):
        loop.train(cfg)
