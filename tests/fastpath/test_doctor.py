import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch

from flashdraft.fastpath.doctor import diagnose_build_log, run_doctor, transformers_generation
from flashdraft.target.tiny import random_model_like, tiny_config

CUDA = torch.cuda.is_available()
NAMES = {"gpu", "torch", "driver", "triton", "fla-core", "causal-conv1d", "transformers", "probe", "fp8 linears"}


def test_doctor_json_on_this_machine():
    out = subprocess.run(
        [sys.executable, "-m", "flashdraft", "doctor", "--json"], capture_output=True, text=True, timeout=600
    )
    result = json.loads(out.stdout)
    assert set(result) >= {"ok", "checks", "layers"}
    assert {c["name"] for c in result["checks"]} == NAMES
    for c in result["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "seconds"} and c["status"] in {
            "ok",
            "warn",
            "fail",
            "info",
        }
        assert c["seconds"] >= 0
    # A slow first run (Triton compiles) is never silent: every step is announced on stderr, stdout stays JSON.
    progress = [line for line in out.stderr.splitlines() if line.startswith("[doctor] ")]
    assert any(line.startswith("[doctor] probe: ") and line.endswith(" s") for line in progress), out.stderr
    assert len(progress) == 2 * len(NAMES), progress  # each check and the probe: started and finished
    assert len(result["layers"]) == 3  # tiny qwen3_5: 3 linear-attention layers of 4
    assert out.returncode == (0 if result["ok"] else 1)
    if not CUDA and shutil.which("nvidia-smi") is None:  # a CPU machine: the torch reference is the right path
        assert result["ok"] is True and out.returncode == 0
        gpu = next(c for c in result["checks"] if c["name"] == "gpu")
        assert gpu["status"] == "info" and "no CUDA device" in gpu["detail"]
        probe = next(c for c in result["checks"] if c["name"] == "probe")
        assert probe["status"] == "info" and "fallback: no CUDA device" in probe["detail"]
        fp8 = next(c for c in result["checks"] if c["name"] == "fp8 linears")
        assert fp8["status"] == "info" and "no FP8 matrix multiplication" in fp8["detail"]


def test_no_cuda_device_beside_an_nvidia_driver_is_a_failure(monkeypatch):
    """A driver but no usable device (a CPU build of torch, a hidden GPU) is the broken set-up doctor exists for."""
    from flashdraft.fastpath import doctor

    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert not doctor.cpu_machine()
    check = doctor.check_gpu()
    assert check.status == "fail" and "no CUDA device" in check.detail


def test_doctor_table_output():
    out = subprocess.run(
        [sys.executable, "-m", "flashdraft", "doctor", "--model", "qwen3_next"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "flashdraft doctor" in out.stdout and "chunk rule" in out.stdout
    if CUDA:
        expected = "fast path complete"
    else:
        expected = "a CPU machine" if shutil.which("nvidia-smi") is None else "fast path incomplete"
    assert expected in out.stdout


def test_doctor_model_from_config_file(tmp_path):
    tiny_config("qwen3_5_moe", num_layers=8).save_pretrained(tmp_path)
    result = run_doctor(functools.partial(random_model_like, str(tmp_path / "config.json"), 8))
    assert [layer["index"] for layer in result["layers"]] == [0, 1, 2, 4, 5, 6]


def test_doctor_bad_model_path_is_exit_2():
    out = subprocess.run(
        [sys.executable, "-m", "flashdraft", "doctor", "--model", "/nonexistent/x"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2 and "/nonexistent/x" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "log, meaning",
    [
        ("  File setup.py\nNameError: name 'bare_metal_version' is not defined", "no nvcc"),
        ("OSError: CUDA_HOME environment variable is not set. Please set it", "CUDA_HOME is unset"),
        (
            "RuntimeError: The detected CUDA version (12.4) mismatches the version that was used to compile\nPyTorch (13.0)",
            "differs",
        ),
        ("ModuleNotFoundError: No module named 'wheel'", "wheel"),
    ],
)
def test_build_log_diagnosis(log, meaning):
    found = diagnose_build_log(log)
    assert found and any(meaning in m for m, _ in found)


def test_build_log_without_known_failure():
    assert diagnose_build_log("Successfully installed causal-conv1d-1.7.0") == []


def test_transformers_generation_names():
    assert transformers_generation("5.14.1").startswith("5.2-5.14")
    assert transformers_generation("5.17.0").startswith("5.15-5.24")
    assert transformers_generation("5.24.0").startswith("5.15-5.24")
    assert transformers_generation("5.25.0").startswith("5.25+: module globals, and transformers sends CPU inputs")
    assert transformers_generation("5.26.0.dev0").endswith("newer than the releases flashdraft was tested with")
    assert transformers_generation("5.13.1") == "unsupported (flashdraft needs >=5.14,<5.26)"
    assert transformers_generation("4.57.0").startswith("unsupported")
