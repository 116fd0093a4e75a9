"""The target: load it whole or frozen (`load.py`, the one loader), keep only the layers the drafter reads and capture
their hidden states (`capture.py`), its MTP layer (`mtp.py`); tiny random models of every supported family for tests
and `flashdraft doctor` (`tiny.py`)."""

from flashdraft.target.capture import FrozenTarget, check_fp8, glue_compile_enabled
from flashdraft.target.load import load_causal_lm, load_frozen_target, load_tokenizer, target_directory

__all__ = [
    "FrozenTarget",
    "check_fp8",
    "glue_compile_enabled",
    "load_causal_lm",
    "load_frozen_target",
    "load_tokenizer",
    "target_directory",
]
