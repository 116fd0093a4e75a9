"""A fast, exact speculative-decoding engine: static caches, exact hybrid rollback, CUDA graphs (see target.py)."""
