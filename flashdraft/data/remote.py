"""Reaching files on an object store (S3 or S3-compatible, through fsspec/s3fs) and failing fast and clearly there.

S3 fails fast (flashdraft.config.S3Config: `s3.connect_timeout`, `s3.read_timeout`, `s3.attempts`): botocore gets the
timeouts and retries each request in its "standard" mode; s3fs's own retry loop, which would multiply those
attempts, is turned off, and a transfer cut or stalled mid-body is read again here instead. An endpoint that never
answers is reported within about attempts x read_timeout, naming the URL, the endpoint and the setting to raise.
Messages show paths with any embedded credentials removed, and never a secret.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fsspec.core import url_to_fs

from flashdraft.config import S3Config
from flashdraft.data.errors import DataError, redact

logger = logging.getLogger(__name__)

_CREDENTIAL_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / ~/.aws/credentials); "
    "for an S3-compatible store also --endpoint-url or AWS_ENDPOINT_URL"
)
_REMOTE_MODULES = ("botocore", "aiobotocore", "s3fs", "aiohttp")
# Exceptions of a response body cut off mid-transfer (botocore retries requests, not the reading of their bodies).
_CUT_OFF = {"ClientPayloadError", "IncompleteRead", "IncompleteReadError", "ResponseStreamingError"}
# A body that stalls longer than read_timeout once its headers came (aiobotocore's name: a request that is never
# answered is botocore's ReadTimeoutError, which botocore itself retries and must not be tried again here).
_STALLED = {"AioReadTimeoutError"}
_THROTTLED = ("SlowDown", "reduce your request rate", "ServiceUnavailable")
_CONNECT = {"ConnectTimeoutError", "EndpointConnectionError", "ClientConnectorError", "ProxyConnectionError"}


def storage_options_for(protocol: str, endpoint_url: str | None = None, s3: S3Config | None = None) -> dict:
    """fsspec options for a protocol: S3 gets `endpoint_url` (argument, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)
    and the timeouts and attempts of `s3` (default: S3Config's)."""
    if protocol not in ("s3", "s3a"):
        return {}
    s3 = s3 or S3Config()
    url = endpoint_url or endpoint()
    # A fresh instance: fsspec caches filesystems by options, and a cached one would keep credentials (or their
    # absence) from before the environment changed.
    opts: dict[str, Any] = {
        "skip_instance_cache": True,
        "config_kwargs": {
            "connect_timeout": s3.connect_timeout,
            "read_timeout": s3.read_timeout,
            "retries": {"total_max_attempts": s3.attempts, "mode": "standard"},
        },
    }
    if url:
        opts["endpoint_url"] = url
    return opts


def open_fs(url: str, endpoint_url: str | None = None, s3: S3Config | None = None):
    """(filesystem, path) of `url` with `storage_options_for` its protocol."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    fs, path = url_to_fs(url, **storage_options_for(protocol, endpoint_url, s3))
    if hasattr(fs, "retries") and protocol in ("s3", "s3a"):
        # One try per s3fs call: botocore retries each request (config_kwargs), and s3fs's own loop around it
        # (a class attribute, 5) would multiply the attempts, nested once more for ranged reads.
        fs.retries = 1
    return fs, path


def endpoint(given: str | None = None) -> str | None:
    """The S3 endpoint in use: `given`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else None (AWS itself)."""
    return given or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling: s3fs and fsspec re-raise the store's errors
    as OSError (a 503 SlowDown: "[Errno 16] Please reduce your request rate") or worse (a body that stalls: an
    IndexError of s3fs's over fsspec's FSTimeoutError), with the original as the cause or context."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 8:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for e in _chain(exc) for c in type(e).__mro__}


def _transfer_fault(exc: BaseException) -> str | None:
    """The name of the body cut off or stalled behind `exc` (None: not such a fault): what to read again."""
    for e in _chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if names & (_CUT_OFF | _STALLED):
            return type(e).__name__
    return None


def is_remote_error(exc: BaseException) -> bool:
    """An error of the object store or the network under it (not of the data)."""
    return any(
        c.__module__.startswith(_REMOTE_MODULES) or issubclass(c, TimeoutError)
        for e in _chain(exc)
        for c in type(e).__mro__
    )


def remote_error(
    exc: BaseException, url: str, s3: S3Config | None = None, endpoint_url: str | None = None
) -> DataError:
    """Turn an fsspec/s3fs/botocore exception into a DataError that names the path and says how to fix it."""
    s3 = s3 or S3Config()
    name = type(exc).__name__
    text = redact(str(exc))
    names = _names(exc)
    name = _transfer_fault(exc) or name  # the fault itself, not s3fs's wrapper of it
    where = f"the S3 endpoint {redact(endpoint_url)}" if endpoint_url else "S3 (no endpoint_url set: AWS itself)"

    def error(what: str) -> DataError:
        return DataError(what, reason="unreadable_file", source=url, skippable=False)

    if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in text:
        return error(f"no S3 credentials found: {_CREDENTIAL_HINT}")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return error(f"access denied ({name}): check the credentials and the bucket policy")
    if isinstance(exc, FileNotFoundError):
        return error("no such file, directory or bucket")
    if any(t in str(e) for e in _chain(exc) for t in _THROTTLED):
        return error(
            f"{where} kept throttling (503 SlowDown) through {s3.attempts} attempts with back-off: read with fewer "
            "workers, or raise s3.attempts (flashdraft prepare: --s3-attempts)"
        )
    if names & _STALLED:
        return error(
            f"the transfer from {where} stalled mid-body for more than s3.read_timeout = {s3.read_timeout:g} s, "
            f"{s3.attempts} times ({name}): check the network, or raise s3.read_timeout / s3.attempts (flashdraft "
            "prepare: --s3-read-timeout / --s3-attempts)"
        )
    if names & _CUT_OFF:
        return error(
            f"the transfer from {where} was cut off mid-body {s3.attempts} times ({name}): check the network, "
            "or raise s3.attempts (flashdraft prepare: --s3-attempts)"
        )
    if names & _CONNECT:
        return error(
            f"cannot connect to {where} ({name}, {s3.attempts} attempts of at most {s3.connect_timeout:g} "
            "s): check the endpoint URL (--endpoint-url / AWS_ENDPOINT_URL) and the network, or raise "
            "s3.connect_timeout (flashdraft prepare: --s3-connect-timeout)"
        )
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return error(
            f"no answer from {where} within s3.read_timeout = {s3.read_timeout:g} s ({s3.attempts} "
            f"attempts, {name}): check that the endpoint is an S3 service that is up, or raise "
            "s3.read_timeout (flashdraft prepare: --s3-read-timeout)"
        )
    return error(f"cannot read ({name}: {text})")


def fs_endpoint(fs) -> str | None:
    """The endpoint URL an fsspec filesystem was opened with (None: AWS itself, or not S3)."""
    return getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")


def read_again_if_cut_off(read, attempts: int, what: str):
    """`read()`, tried up to `attempts` times while the answer is cut off mid-body (botocore retries requests,
    not the reading of their bodies); any other error, or the last cut, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return read()
        except Exception as exc:
            fault = _transfer_fault(exc)
            if attempt == attempts or fault is None:
                raise
            logger.warning(
                "%s: transfer cut off (%s), reading again (attempt %d of %d)",
                what,
                fault,
                attempt + 1,
                attempts,
            )
            time.sleep(min(0.1 * 2**attempt, 5.0))
    raise AssertionError("unreachable")
