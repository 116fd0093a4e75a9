"""The speculative-decoding engine: static caches, exact hybrid rollback, CUDA graphs (see target_runner.py)."""
