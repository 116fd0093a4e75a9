"""The target's MTP layer read from checkpoints: the released (sharded) layout, a single file, the bundled target;
what does not fit is refused with the tensors named.

`save_released_layout` writes what Qwen3.5 checkpoints look like: the target's tensors in one shard, the `mtp.*`
tensors in another, `model.safetensors.index.json` mapping every tensor to its shard, `mtp_num_hidden_layers: 1`
in config.json. It is written here, independently of the package's own writer (`write_mtp`).
"""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft import bundled
from flashdraft.target import load_causal_lm
from flashdraft.target.mtp import INDEX, MTPHead, has_mtp, load_mtp, require_mtp, write_mtp

from . import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def save_released_layout(target, head, directory):
    """`target` and its MTP `head` in the released checkpoint layout (see the module docstring)."""
    target.save_pretrained(directory)
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    mtp = {"mtp." + k: v.contiguous() for k, v in head.state_dict().items()}
    save_file(weights, str(directory / SHARDS[0]), metadata={"format": "pt"})
    save_file(mtp, str(directory / SHARDS[1]), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(weights, SHARDS[0]), **dict.fromkeys(mtp, SHARDS[1])}
    total = sum(t.nbytes for t in [*weights.values(), *mtp.values()])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _random_head(target, seed: int) -> MTPHead:
    torch.manual_seed(seed)
    head = MTPHead.for_target(target)
    for parameter in head.parameters():  # norms too: an all-zero norm weight would hide a swapped pair
        torch.nn.init.normal_(parameter)
    return head


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3_5", dtype=torch.float32, seed=31)


def _assert_same(loaded: MTPHead, head: MTPHead):
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_released_layout_loads(target, tmp_path):
    head = _random_head(target, 1)
    directory = save_released_layout(target, head, tmp_path / "released")
    assert "mtp.fc.weight" in require_mtp(directory) and "mtp.layers.0.self_attn.q_proj.weight" in require_mtp(
        directory
    )
    loaded = load_mtp(target, directory)
    _assert_same(loaded, head)
    assert loaded.fc.weight.shape == (64, 128) and loaded.fc.bias is None and not loaded.training


def test_write_mtp_adds_the_head_to_a_single_file_checkpoint(target, tmp_path):
    from transformers import AutoModelForCausalLM

    target.save_pretrained(tmp_path / "plain")
    before = load_file(tmp_path / "plain" / "model.safetensors")
    assert not has_mtp(tmp_path / "plain")
    head = _random_head(target, 2)
    write_mtp(tmp_path / "plain", head, tmp_path / "single")
    after = load_file(tmp_path / "single" / "model.safetensors")
    assert {k for k in after if not k.startswith("mtp.")} == set(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert json.loads((tmp_path / "single" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    _assert_same(load_mtp(target, tmp_path / "single"), head)
    # Written again with another head: the old mtp.* tensors are replaced, not duplicated.
    other = _random_head(target, 3)
    write_mtp(tmp_path / "single", other)
    _assert_same(load_mtp(target, tmp_path / "single"), other)
    # transformers loads the target from it and leaves the mtp.* tensors out.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "single")
    assert not any(k.startswith("mtp.") for k in model.state_dict())
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)


def test_a_checkpoint_without_mtp_is_refused(target, tmp_path):
    target.save_pretrained(tmp_path / "no-mtp")
    with pytest.raises(ValueError, match="has no MTP weights") as info:
        load_mtp(target, tmp_path / "no-mtp")
    assert str(tmp_path / "no-mtp") in str(info.value) and "--baselines mtp" in str(info.value)


def test_mtp_weights_that_do_not_fit_are_named(target, tmp_path):
    head = _random_head(target, 4)
    directory = save_released_layout(target, head, tmp_path / "bad")
    weights = load_file(directory / SHARDS[1])
    weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :64].contiguous()
    del weights["mtp.norm.weight"]
    weights["mtp.extra.weight"] = torch.zeros(3)
    save_file(weights, str(directory / SHARDS[1]))
    index = json.loads((directory / INDEX).read_text())
    del index["weight_map"]["mtp.norm.weight"]
    index["weight_map"]["mtp.extra.weight"] = SHARDS[1]
    (directory / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"mtp\.fc\.weight: \(64, 64\), expected \(64, 128\)") as info:
        load_mtp(target, directory)
    assert "missing mtp.norm.weight" in str(info.value) and "unexpected mtp.extra.weight" in str(info.value)


def test_more_than_one_mtp_layer_is_refused(target, tmp_path):
    directory = save_released_layout(target, _random_head(target, 5), tmp_path / "two")
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 2
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="declares 2 MTP layers"):
        load_mtp(target, directory)


def test_per_expert_moe_weights_are_fused(tmp_path):
    """Qwen3-Next ships experts one by one (`mlp.experts.E.gate_proj.weight`); transformers' layer holds them
    fused (gate rows, then up rows)."""
    target = tiny_target("qwen3_next", dtype=torch.float32, seed=5)
    head = _random_head(target, 6)
    weights = {}
    for name, tensor in head.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                weights[f"mtp.{prefix}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                weights[f"mtp.{prefix}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                weights[f"mtp.{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            weights["mtp." + name] = tensor
    assert any(".experts.3.up_proj" in k for k in weights)
    target.save_pretrained(tmp_path / "moe")
    save_file(
        {**load_file(tmp_path / "moe" / "model.safetensors"), **weights}, str(tmp_path / "moe" / "model.safetensors")
    )
    _assert_same(load_mtp(target, tmp_path / "moe"), head)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def _loud_transformers_records(load) -> tuple[object, list[str]]:
    """(load(), the messages transformers logged at WARNING or above while it ran)."""
    from transformers.utils import logging as hf_logging

    records = _Records()
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(records)
    try:
        result = load()
    finally:
        logger.removeHandler(records)
    return result, [m for m in records.messages if m.split(":")[0] in ("WARNING", "ERROR", "CRITICAL")]


def test_mtp_tensors_a_model_class_does_not_expect_are_reported(tmp_path):
    """The check below sees transformers' load report: a Qwen3 class (which ships no MTP layer, so does not skip
    mtp.*) reports the tensor as unexpected."""
    from transformers import AutoModelForCausalLM

    target = tiny_target("qwen3", dtype=torch.float32, seed=7)
    target.save_pretrained(tmp_path)
    weights = {**load_file(tmp_path / "model.safetensors"), "mtp.fc.weight": torch.zeros(2, 2)}
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, loud = _loud_transformers_records(lambda: AutoModelForCausalLM.from_pretrained(tmp_path))
    assert any("mtp.fc.weight" in m for m in loud), loud


def test_the_bundled_target_ships_an_mtp_head_that_transformers_leaves_out_quietly(recwarn):
    """The bundled target carries its MTP head in the released names; transformers loads the target from the same
    file with no warning and no log message at WARNING or above, and the head loads through the same loader."""
    target, loud = _loud_transformers_records(
        lambda: load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    )
    assert not loud, loud
    # Python warnings of the load itself (fla's note that Triton needs a GPU, on a CPU machine, is not one).
    from_load = [str(w.message) for w in recwarn.list if "transformers" in w.filename or "mtp" in str(w.message)]
    assert not from_load, from_load
    assert not any(k.startswith("mtp.") for k in target.state_dict())
    assert json.loads((bundled.target_dir() / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    head = load_mtp(target, bundled.target_dir())
    assert head.fc.weight.shape == (256, 512) and next(head.parameters()).dtype == torch.float32
    # Trained weights, not an initialisation: the norms moved off zero and fc is not a fresh normal(0.02) draw.
    assert head.norm.weight.abs().mean() > 0.01 and abs(head.fc.weight.std().item() - 0.02) > 0.002
