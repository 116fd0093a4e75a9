"""The older transformers fast-path generation (5.2-5.14: per-layer attributes set at import), in a subprocess.

.ci/run installs transformers 5.14.1 into a side directory and points FLASHDRAFT_OLD_TRANSFORMERS at it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

OLD = os.environ.get("FLASHDRAFT_OLD_TRANSFORMERS")

SCRIPT = textwrap.dedent(
    """
    import torch, transformers
    assert transformers.__version__.startswith("5.14"), transformers.__version__
    from flashdraft import fastpath
    from flashdraft.fastpath.patch import INSTANCE
    from flashdraft.tiny_configs import build_tiny_target

    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        model = build_tiny_target(family, num_layers=4, seed=3)
        ids = torch.randint(0, 256, (1, 11))
        with torch.no_grad():
            before = model(ids).logits
        # What transformers chose at import, per layer (on a CPU 5.14 deems fla unavailable: torch / nn.Conv1d).
        untouched = fastpath.probe(model)
        assert untouched.generation == INSTANCE
        assert all(u.impl == "torch" for l in untouched.layers for u in l.ops.values()), untouched
        conv = untouched.layers[0].ops["causal_conv1d_fn"]
        assert "nn.Conv1d" in conv.reason, conv
        report = fastpath.enable(model, strict=False)
        assert report.generation == INSTANCE and len(report.layers) == 3
        for layer in report.layers:
            for use in layer.ops.values():
                assert use.impl == "torch" and "no CUDA device" in use.reason, use
        with torch.no_grad():
            after = model(ids).logits
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
        fastpath.disable(model)
        assert fastpath.probe(model).layers[0].ops["causal_conv1d_fn"].reason == conv.reason
    print("OK")
    """
)


def test_transformers_5_14_generation():
    if not OLD:
        if os.environ.get("CI"):
            pytest.fail("FLASHDRAFT_OLD_TRANSFORMERS is not set: .ci/run installs transformers 5.14.1 for this test")
        pytest.skip("set FLASHDRAFT_OLD_TRANSFORMERS to a --target dir holding transformers 5.14.1 (see .ci/run)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([OLD, os.getcwd()]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
