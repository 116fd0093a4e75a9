"""The releases of torch, transformers and triton that flashdraft supports, and what differs between them.

`check_supported()` runs when `flashdraft` is imported: a release older than the oldest one supported is refused
with the installed version and the supported range, before anything fails deep inside a model. A release newer
than the newest one tested is not refused (`flashdraft doctor` reports it as untested).

The transformers releases differ in how a model takes and returns its cache: 5.24 renamed the keyword
`past_key_values` to `cache` (the old name is accepted with a FutureWarning until 5.40), so callers build the
keyword with `cache_kwargs` and read a forward's cache with `returned_cache`.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

# (distribution, oldest supported, first release not tested) — keep in step with pyproject.toml's pins.
SUPPORTED = {
    "torch": ("2.11", "2.16"),
    "transformers": ("5.14", "5.26"),
    "triton": ("3.5", "3.10"),
}
# transformers 5.24 renamed the cache keyword of model forwards (`past_key_values` -> `cache`).
CACHE_RENAMED = Version("5.24")


def supported_range(dist: str) -> str:
    low, high = SUPPORTED[dist]
    return f">={low},<{high}"


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> Version:
    # Local and pre-release parts ("2.11.0+cu130", "5.26.0.dev0") do not move a release across the range.
    return Version(Version(version).base_version)


def status(dist: str, version: str | None = None) -> str:
    """ "ok", "too old", "untested" (newer than the newest tested) or "missing"."""
    version = installed(dist) if version is None else version
    if version is None:
        return "missing"
    low, high = SUPPORTED[dist]
    release = _release(version)
    if release < Version(low):
        return "too old"
    return "untested" if release >= Version(high) else "ok"


def unsupported_message(dist: str, version: str) -> str:
    return (
        f"flashdraft needs {dist} {supported_range(dist)}; this environment has {dist} {version}, older than "
        f"the oldest supported release. Install a supported one: pip install '{dist}{supported_range(dist)}'"
    )


def check_supported() -> None:
    """Raise ImportError naming the first installed release that is older than the supported range."""
    for dist in SUPPORTED:
        version = installed(dist)
        if version is not None and status(dist, version) == "too old":
            raise ImportError(unsupported_message(dist, version))


def _cache_renamed() -> bool:
    import transformers

    return _release(transformers.__version__) >= CACHE_RENAMED


def cache_kwargs(cache) -> dict:
    """The keyword argument that passes `cache` to a transformers model forward of the installed release."""
    return {"cache": cache} if _cache_renamed() else {"past_key_values": cache}


def returned_cache(output):
    """The cache a transformers model forward returned (`output.cache` from 5.24 on, else `past_key_values`)."""
    return output.cache if _cache_renamed() else output.past_key_values
