"""What a run loads before its first step."""

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train.setup import load_inputs


def _cfg(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", ["data.eval_limit=1", f"log.out={out}", *extra])


def test_target_compile_reaches_the_frozen_target(tmp_path):
    """`target.compile` compiles the glue of the target the trainer (and `flashdraft features`) loads; auto leaves
    it eager on the CPU. torch.compile is lazy, so nothing compiles here."""
    for setting, compiled in (("false", False), ("true", True), ("auto", False)):
        cfg = _cfg(tmp_path / setting, f"target.compile={setting}")
        target = load_inputs(cfg, tmp_path / setting, console=None)[2]
        assert target.glue_compiled is compiled
