"""flashdraft: train DFlash speculative-decoding drafters for (hybrid Gated DeltaNet) target LLMs."""

from flashdraft.versions import check_supported

__version__ = "0.1.0"

check_supported()
