"""Every generation of transformers' Gated DeltaNet layer and its hooks, each release in a process of its own.

The releases that changed what flashdraft relies on (found by diffing the qwen3_5, qwen3_5_moe and qwen3_next
modeling files and cache_utils.py): 5.14 (kernels in layer attributes), 5.15 (module globals), 5.16 (cache
`has_previous_state(state_idx)`), 5.17 (fla's kernels found whatever the import order), 5.21 (cache accessors `get_conv_state`, `is_recording_past`), 5.23 (q/k group
repeat inside the rule functions; `DummyLayer`), 5.24 (`past_key_values` -> `cache`), 5.25 (`causal_conv1d_forward`,
transformers' own device check, linear-attention token counts in the cache). generation_checks.py says what is
checked.

The installed release always runs. Others are installed side by side (`pip install --no-deps --target DIR
transformers==X`, plus the tokenizers / huggingface_hub X needs when the environment's do not fit) and listed in
FLASHDRAFT_TRANSFORMERS_DIRS (os.pathsep-separated directories); .ci/run does that.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DIRS = [d for d in os.environ.get("FLASHDRAFT_TRANSFORMERS_DIRS", "").split(os.pathsep) if d]
REPO = Path(__file__).resolve().parents[2]
UNSET = "FLASHDRAFT_TRANSFORMERS_DIRS is unset: no other transformers release installed side by side to check"
# The installed release always; each listed release; or, with none listed, one skipped case that says so.
RELEASES = [
    pytest.param(None, id="installed"),
    *[pytest.param(d, id=Path(d).name) for d in DIRS],
    *([] if DIRS else [pytest.param("", id="side-by-side", marks=pytest.mark.skip(reason=UNSET))]),
]


def _release_of(directory: str) -> str:
    found = sorted(Path(directory).glob("transformers-*.dist-info"))
    if len(found) != 1:
        pytest.fail(f"{directory}: expected one transformers-*.dist-info, found {len(found)}", pytrace=False)
    return found[0].name.removeprefix("transformers-").removesuffix(".dist-info")


@pytest.mark.parametrize("directory", RELEASES)
def test_generation(directory):
    path = [str(REPO)] if directory is None else [directory, str(REPO)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    args = [] if directory is None else [_release_of(directory)]
    out = subprocess.run(
        [sys.executable, "-m", "tests.fastpath.generation_checks", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr[-6000:]


def test_ci_lists_side_by_side_releases():
    if not DIRS:
        if os.environ.get("CI"):
            pytest.fail("FLASHDRAFT_TRANSFORMERS_DIRS is empty: .ci/run installs the other transformers generations")
        pytest.skip(UNSET)
    for directory in DIRS:
        assert _release_of(directory).startswith("5."), directory
