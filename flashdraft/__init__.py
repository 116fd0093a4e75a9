"""flashdraft: train DFlash speculative-decoding drafters for (hybrid Gated DeltaNet) target LLMs."""

__version__ = "0.1.0"
