"""Where a model comes from: a local directory or a hub id, with no download unless the user allows it.

Unset HF_HUB_OFFLINE means offline on purpose (a training job should never start a silent multi-GB download); a hub
id already in the local cache loads either way. Only safetensors weights load: unpickling can run arbitrary code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model.ckpt")
_FALSE = ("0", "false", "no", "off")
# transformers 5.25+ "kernelizes" every model it loads when the `kernels` package is installed (it is a dependency):
# it fetches kernels from the Hub at load time and may replace whole layers, the Gated DeltaNet among them, bypassing
# the fast path flashdraft patches and proves. Every load in flashdraft passes these (older releases accept them too).
NO_HUB_KERNELS = {"use_kernels": False}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_local_files_only(local_files_only: bool | None) -> bool:
    """Whether loading may download: an explicit argument wins; otherwise only when HF_HUB_OFFLINE is *explicitly*
    set to a false value ("0", "false", "no", "off").

    Unset means offline on purpose: a training job should never start a silent multi-GB download; a hub id that
    is already in the local cache loads either way.
    """
    if local_files_only is not None:
        return bool(local_files_only)
    env = os.environ.get("HF_HUB_OFFLINE")
    return env is None or env.strip().lower() not in _FALSE


def is_hub_id(name: str | os.PathLike) -> bool:
    """Whether `name` has the shape of a hub id ('org/name'); anything else can only be a local path."""
    return bool(_HUB_ID.match(str(name)))


def resolve_model_dir(
    path_or_id: str | os.PathLike,
    *,
    what: str = "target",
    local_files_only: bool | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    allow_patterns: Sequence[str] = ("*.json", "*.safetensors"),
) -> Path:
    """The local directory of a model: `path_or_id` itself, or the hub cache's snapshot of a hub id.

    Nothing is downloaded unless `resolve_local_files_only(local_files_only)` allows it (by default it does not:
    an uncached hub id is a FileNotFoundError saying how to allow the download). `what` names the model in messages;
    `allow_patterns` are the files a download fetches (plus *.py with `trust_remote_code`).
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"{what} {path} is a file; expected a model directory with config.json")
        return path
    name = str(path_or_id)
    if not is_hub_id(name):
        raise FileNotFoundError(f"{what} directory {name} does not exist (and is not a hub id like 'Qwen/Qwen3-8B')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = list(allow_patterns) + (["*.py"] if trust_remote_code else [])
    try:
        return Path(
            snapshot_download(
                name,
                allow_patterns=patterns,
                revision=revision,
                local_files_only=resolve_local_files_only(local_files_only),
            )
        )
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"{what} {name} is neither a local directory nor in the hub cache, and downloads are off by default: "
            "set HF_HUB_OFFLINE=0 to download it (or pass local_files_only=False)"
        ) from err


def check_checkpoint(directory: Path, what: str = "target") -> None:
    """Raise unless `directory` has a config.json and safetensors weights (pickle-only weights are refused)."""
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{what} directory {directory} has no config.json")
    if any(directory.glob("*.safetensors")):
        return
    pickled = [name for name in _PICKLE_WEIGHTS if (directory / name).exists()]
    if pickled:
        raise ValueError(
            f"{what} {directory} holds only pickle weights ({', '.join(pickled)}); flashdraft loads safetensors "
            "only, because unpickling can run arbitrary code. In an environment you trust, convert with: "
            "safetensors.torch.save_file(torch.load(p, weights_only=True), 'model.safetensors')"
        )
    raise FileNotFoundError(f"{what} directory {directory} has no *.safetensors weights")
