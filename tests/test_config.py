import re

import pytest

from flashdraft.config import ConfigError, RunConfig, describe_fields, load_config


def test_defaults_are_the_paper_recipe():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.recipe.num_anchors) == (5, 16, 512)
    assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.optim.warmup_ratio, cfg.train.epochs) == (6e-4, 1.0, 0.04, 6)
    assert cfg.data.max_length == 3072


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 7\noptim:\n  lr: 3.0e-4\ndata:\n  train: [a.jsonl, 's3://b/*.jsonl']\n")
    cfg = load_config(path, ["optim.lr=1e-3", "drafter.target_layer_ids=[1, 3]", "log.trackers=[wandb]"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3
    assert cfg.data.train == ["a.jsonl", "s3://b/*.jsonl"] and cfg.drafter.target_layer_ids == [1, 3]
    assert cfg.log.trackers == ["wandb"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=1", "unknown field train.lr"),
        ("train.max_step=3", "did you mean train.max_steps"),
        ("optim.lr=abc", "optim.lr: expected float, got str"),
        ("train.epochs=true", "train.epochs: expected int, got bool"),
        ("drafter.block_size=1", "drafter.block_size = 1: must be >= 2"),
        ("data.max_length=4", "data.max_length = 4: must be >= drafter.block_size"),
        ("data.overlong=cut", "data.overlong"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("drafter.target_layer_ids=[2, 2]", "must be distinct"),
        ("recipe.num_anchors=0", "recipe.num_anchors = 0"),
        ("recipe.anchor_sampling=random", "recipe.anchor_sampling = 'random': must be uniform or stratified"),
        ("recipe.loss_weighting=linear", "recipe.loss_weighting = 'linear': must be exp or dpace"),
        ("recipe.dpace_alpha=0", "recipe.dpace_alpha = 0.0: must be in (0, 1]"),
        ("recipe.loss=kl", "recipe.loss = 'kl': must be ce or lk"),
        ("recipe.lk_eta=-1", "recipe.lk_eta = -1.0: must be >= 0"),
        ("recipe.reveal=1", "recipe.reveal = 1.0: must be in [0, 1)"),
        ("recipe.labels=soft", "recipe.labels = 'soft': must be token or target"),
        ("log.trackers=wandb", "log.trackers: expected a list"),
        ("nonsense", "expected section.field=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_gamma_belongs_to_the_exp_weighting():
    cfg = load_config(None, ["recipe.loss_weighting=dpace", "recipe.loss=lk", "recipe.anchor_sampling=stratified"])
    assert (cfg.recipe.loss_weighting, cfg.recipe.loss, cfg.recipe.anchor_sampling) == ("dpace", "lk", "stratified")
    with pytest.raises(ConfigError, match="recipe.gamma = 7.0: is the exp weighting's decay.*set it to null"):
        load_config(None, ["recipe.loss_weighting=dpace", "recipe.gamma=7"])


def test_target_labels_may_read_offline_features():
    """The features then must hold the target's final hidden states: checked when the run opens them
    (tests/data/test_features.py), not here."""
    cfg = load_config(None, ["recipe.labels=target", "data.features=/data/features"])
    assert (cfg.recipe.labels, cfg.data.features) == ("target", "/data/features")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter.family=dsprak"], "drafter.family = 'dsprak': must be dflash, dspark, dflash2"),
        (["drafter.dspark.markov_head_type=lstm"], "drafter.dspark.markov_head_type = 'lstm': must be vanilla"),
        (["drafter.dspark.markov_rank=-1"], "drafter.dspark.markov_rank = -1: must be >= 0"),
        (["drafter.dspark.markov_rank=0"], "drafter.dspark.confidence_head_with_markov = True: needs the Markov"),
        (["recipe.dspark.confidence=-1"], "recipe.dspark.confidence = -1.0: must be >= 0"),
        (["recipe.dspark.ce=0", "recipe.dspark.distance=0"], "recipe.dspark.ce = 0.0: and recipe.dspark.distance"),
        (["drafter.family=dspark", "recipe.labels=target"], "recipe.labels = 'target': is DFlash's option"),
        (["drafter.family=dspark", "recipe.loss=lk"], "recipe.loss = 'lk': must be ce with drafter.family = dspark"),
        (["drafter.family=dspark", "recipe.reveal=0.5"], "recipe.reveal = 0.5: must be 0 with drafter.family"),
        (["drafter.dspark.markov_width=3"], "unknown field drafter.dspark.markov_width"),
        (["drafter.dflash2.selector_top_k=0"], "drafter.dflash2.selector_top_k = 0: must be >= 1"),
        (["drafter.dflash2.conv_kernel_size=17"], "drafter.dflash2.conv_kernel_size = 17: must be <= drafter.block"),
        (["recipe.dflash2.absent=keep"], "recipe.dflash2.absent = 'keep': must be drop"),
        (["recipe.dflash2.selector=-1"], "recipe.dflash2.selector = -1.0: must be >= 0"),
        (["recipe.dflash2.base=0", "recipe.dflash2.selector=0"], "recipe.dflash2.base = 0.0: and recipe.dflash2"),
        (["drafter.family=dflash2", "recipe.reveal=0.5"], "recipe.reveal = 0.5: must be 0 with drafter.family"),
    ],
)
def test_bad_family_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_bad_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {epochs: 0}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: train.epochs = 0"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("train: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_field_is_documented():
    rows = describe_fields()
    assert len(rows) > 30
    undocumented = [name for name, _, doc in rows if not doc]
    assert undocumented == []
