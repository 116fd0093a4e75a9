"""The frozen target: load it (`load.py`), keep only the layers the drafter reads, capture their hidden states
(`capture.py`); tiny random targets of every supported family for tests and `flashdraft doctor` (`tiny.py`)."""

from flashdraft.target.capture import FrozenTarget, check_fp8, glue_compile_enabled
from flashdraft.target.load import build_target, load_model, load_target

__all__ = ["FrozenTarget", "build_target", "check_fp8", "glue_compile_enabled", "load_model", "load_target"]
