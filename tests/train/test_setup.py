"""What a run loads before its first step."""

import dataclasses

import pytest

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train.setup import load_inputs, setup
from tests import SHIPPED_DRAFTER


def _cfg(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, "data.eval_limit=1", f"log.out={out}", *extra])


def test_target_compile_reaches_the_frozen_target(tmp_path):
    """`target.compile` compiles the glue of the target the trainer (and `flashdraft features`) loads; auto leaves
    it eager on the CPU. torch.compile is lazy, so nothing compiles here."""
    for setting, compiled in (("false", False), ("true", True), ("auto", False)):
        cfg = _cfg(tmp_path / setting, f"target.compile={setting}")
        target = load_inputs(cfg, tmp_path / setting, console=None)[2]
        assert target.glue_compiled is compiled


def test_a_setup_is_built_once_and_not_replaced_during_the_run(tmp_path):
    """Everything a run holds before its first step, in a frozen Setup: training changes the drafter's weights and
    the loader's place, never which objects the run holds."""
    s = setup(_cfg(tmp_path, "train.max_steps=5"), tmp_path, None)
    assert s.total_steps == 5 and s.batches.step == 0 and s.features is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.drafter = None
