"""DSpark's heads on the backbone: the reference's parameter names and initialisation, left-to-right drafting that
agrees with teacher-forced logits for every Markov variant, the confidence head's inputs, checkpoints and errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.families import family_of
from flashdraft.drafter.heads import MARKOV_KINDS
from flashdraft.target.tiny import tiny_config


def tiny_dspark(seed=0, **fields) -> DFlashDraftModel:
    torch.manual_seed(seed)
    fields = {"markov_rank": 8, **fields}
    config = tiny_config("qwen3", num_layers=8, vocab_size=96)
    return DFlashDraftModel.from_target(
        config, num_layers=1, block_size=5, mask_token_id=5, family="dspark", family_fields=fields
    ).double()


def test_parameter_names_shapes_and_initialisation_are_the_references():
    drafter = tiny_dspark(markov_head_type="rnn")
    params = dict(drafter.named_parameters())
    assert params["markov_head.markov_w1.weight"].shape == (96, 8)
    assert params["markov_head.markov_w2.weight"].shape == (96, 8)
    assert params["markov_head.joint_proj.weight"].shape == (24, 16 + 64)
    assert params["confidence_head.proj.weight"].shape == (1, 64 + 8)
    # post_init's normal(0, initializer_range) and zero biases, as the reference's heads get.
    std = drafter.config.initializer_range
    assert abs(params["markov_head.markov_w2.weight"].std().item() - std) < 0.3 * std
    assert not params["confidence_head.proj.bias"].any() and not params["markov_head.joint_proj.bias"].any()
    assert drafter.family == "dspark" and drafter.draft_offset == 1 and drafter.num_drafts == 5
    gated = dict(tiny_dspark(markov_head_type="gated").named_parameters())
    assert gated["markov_head.gate_proj.weight"].shape == (8, 64 + 8) and "markov_head.joint_proj.weight" not in gated
    plain = dict(tiny_dspark(confidence_head_with_markov=False).named_parameters())
    assert plain["confidence_head.proj.weight"].shape == (1, 64)
    assert "confidence_head.proj.weight" not in dict(tiny_dspark(enable_confidence_head=False).named_parameters())


@pytest.mark.parametrize("kind", MARKOV_KINDS)
def test_walking_left_to_right_gives_the_teacher_forced_logits_of_its_own_drafts(kind):
    """`walk` (one step at a time, as drafting runs) and `draft_logits` (whole blocks at once, as training runs)
    compute the same logits when the teacher-forced previous tokens are the walk's own drafts; the bias is not
    zero, so the drafts depend on each other."""
    drafter = tiny_dspark(markov_head_type=kind, seed=1)
    with torch.no_grad():  # a bias strong enough to change the argmax
        drafter.markov_head.markov_w1.weight.mul_(50)
        drafter.markov_head.markov_w2.weight.mul_(50)
    g = torch.Generator().manual_seed(0)
    hidden = 0.1 * torch.randn(7, 64, generator=g, dtype=torch.float64)
    head = torch.randn(96, 64, generator=g, dtype=torch.float64)
    first = torch.tensor(11)
    drafts, logits = drafter.walk(hidden, head, first, lambda k, row: row.argmax())
    prev = torch.cat([first.view(1), drafts[:-1]])
    torch.testing.assert_close(logits, drafter.draft_logits(hidden, head, prev), rtol=1e-12, atol=1e-12)
    assert torch.equal(drafts, logits.argmax(-1))
    assert not torch.equal(drafts, (hidden @ head.t()).argmax(-1))  # the head changed some drafts


def test_a_dflash_walk_picks_each_position_from_the_backbone_alone():
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(tiny_config("qwen3", num_layers=8), num_layers=1, mask_token_id=5)
    hidden, head = torch.randn(4, 64), torch.randn(256, 64)
    drafts, logits = drafter.walk(hidden, head, torch.tensor(3), lambda k, row: row.argmax())
    torch.testing.assert_close(logits, hidden @ head.t())
    assert drafter.markov_head is None and drafter.num_drafts == drafter.block_size - 1


def test_confidence_reads_the_hidden_state_and_the_markov_embedding_of_the_previous_token():
    drafter = tiny_dspark()
    hidden, prev = torch.randn(3, 64, dtype=torch.float64), torch.tensor([4, 9, 4])
    got = drafter.confidence_logits(hidden, prev)
    proj = drafter.confidence_head.proj
    want = torch.cat([hidden, drafter.markov_head.markov_w1.weight[prev]], -1) @ proj.weight[0] + proj.bias
    torch.testing.assert_close(got, want.float())
    assert got[0] != got[2]  # same token, different hidden state


def test_a_checkpoint_keeps_the_family_its_fields_and_heads(tmp_path):
    drafter = tiny_dspark(markov_head_type="gated", sample_from_anchor=False)
    drafter.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and "auto_map" not in config
    assert config["dflash_config"]["markov_head_type"] == "gated"
    assert config["dflash_config"]["sample_from_anchor"] is False
    assert "markov_head.gate_proj.weight" in load_file(tmp_path / "d" / "model.safetensors")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float64)
    assert loaded.family == "dspark" and loaded.draft_offset == 0 and loaded.num_drafts == 4
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_deepspec_layout_is_read_as_dspark_and_the_dflash2_architecture_as_dflash2():
    config = tiny_dspark().config
    config.architectures = ["Qwen3DSparkModel"]
    assert family_of(config) == "dspark"
    config.architectures = ["DFlash2DraftModel"]
    assert family_of(config) == "dflash2"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(markov_head_type="lstm"), "markov_head_type must be one of vanilla, gated, rnn"),
        (dict(markov_rank=0), "confidence_head_with_markov needs the Markov head"),
        (dict(markov_rank=-2), "markov_rank must be an integer >= 0"),
        (dict(sample_from_anchor="yes"), "sample_from_anchor must be true or false"),
        (dict(markov_width=3), "has no field markov_width"),
    ],
)
def test_bad_family_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_dspark(**fields)


def test_without_a_markov_head_the_confidence_reads_the_hidden_state_only():
    drafter = tiny_dspark(markov_rank=0, confidence_head_with_markov=False)
    assert drafter.markov_head is None and drafter.confidence_head.proj.in_features == 64
    hidden = torch.randn(2, 64, dtype=torch.float64)
    assert drafter.confidence_logits(hidden, torch.tensor([1, 2])).shape == (2,)


def test_a_checkpoint_missing_a_tensor_or_of_another_family_is_refused_naming_what_differs(tmp_path):
    """transformers would initialise a missing weight at random and drop an unknown one; a drafter is refused."""
    drafter = tiny_dspark()
    drafter.save_pretrained(tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    from safetensors.torch import save_file

    save_file(
        {k: v for k, v in weights.items() if k != "markov_head.markov_w2.weight"}, tmp_path / "d" / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"missing \['markov_head.markov_w2.weight'\]"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]  # a DSpark checkpoint labelled DFlash
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\(a dflash drafter\): extra \['confidence_head.proj.bias'"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
