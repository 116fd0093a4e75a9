"""The peak rate MFU is measured against comes from the GPU the run is on (mocked device names, SM counts)."""

import re
from types import SimpleNamespace

import pytest
import torch

from flashdraft.telemetry import flops

CUDA = torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch):
    """`gpu(name, capability, sms)` makes torch report that GPU."""

    def make(name: str, capability: tuple[int, int], sms: int) -> None:
        props = SimpleNamespace(name=name, major=capability[0], minor=capability[1], multi_processor_count=sms)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return make


@pytest.mark.parametrize(
    "name, capability, sms, tflops",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 132, 989.5),
        ("NVIDIA H100 PCIe", (9, 0), 114, 756.0),
        ("NVIDIA H100 NVL", (9, 0), 132, 835.5),
        ("NVIDIA H200", (9, 0), 132, 790.0),  # measured in this project, not the datasheet's 989.5
        ("NVIDIA H200 NVL", (9, 0), 132, 835.5),
        ("NVIDIA H20", (9, 0), 78, 148.0),
        ("NVIDIA H800", (9, 0), 132, 989.5),
        ("NVIDIA GH200 480GB", (9, 0), 132, 989.5),
        ("NVIDIA B200", (10, 0), 148, 2250.0),
        ("NVIDIA B100", (10, 0), 132, 1750.0),
        ("NVIDIA GB200", (10, 0), 152, 2500.0),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 312.0),
        ("NVIDIA A100 80GB PCIe", (8, 0), 108, 312.0),
        ("NVIDIA A10", (8, 6), 72, 125.0),
        ("NVIDIA L40S", (8, 9), 142, 362.05),
        ("NVIDIA L40", (8, 9), 142, 181.05),
        ("NVIDIA L4", (8, 9), 58, 121.0),
        ("NVIDIA GeForce RTX 4090", (8, 9), 128, 165.2),
    ],
)
def test_known_gpus_get_their_own_peak(gpu, name, capability, sms, tflops):
    gpu(name, capability, sms)
    peak = flops.device_peak(CUDA)
    assert peak is not None and peak.flops == tflops * 1e12
    assert f"{tflops:g} TFLOP/s" in flops.describe(CUDA, peak) and name in flops.describe(CUDA, peak)


@pytest.mark.parametrize(
    "name, capability, sms",
    [
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188),  # not in the table
        ("NVIDIA A10G", (8, 6), 80),  # a name that only starts like a known one
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", (9, 0), 60),  # a slice of a known GPU: fewer SMs
        ("NVIDIA GeForce RTX 4090 D", (8, 9), 114),  # another GPU under a known name
        ("NVIDIA H200", (8, 0), 132),  # a name that disagrees with its capability
    ],
)
def test_unknown_gpus_have_no_peak(gpu, name, capability, sms):
    gpu(name, capability, sms)
    assert flops.device_peak(CUDA) is None
    assert "MFU: unknown" in flops.describe(CUDA, None) and "train.peak_tflops" in flops.describe(CUDA, None)


def test_the_h200_row_says_it_is_measured_and_keeps_the_datasheet_figure(gpu):
    gpu("NVIDIA H200", (9, 0), 132)
    peak = flops.device_peak(CUDA)
    assert "measured" in peak.source and "datasheet 989.5" in peak.source


def test_a_given_peak_wins_and_a_cpu_has_none(gpu):
    gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188)
    assert flops.device_peak(CUDA, override_tflops=500.0).flops == 500e12
    assert flops.device_peak(torch.device("cpu")) is None
    assert flops.describe(torch.device("cpu"), None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_here_matches_its_row():
    """On a GPU the table names, the name, capability and SM count it reports all agree with its row."""
    name = torch.cuda.get_device_name()
    if not any(re.search(gpu.name, name, re.IGNORECASE) for gpu in flops.GPUS):
        pytest.skip(f"{name} is not in the table")
    peak = flops.device_peak(CUDA)
    assert peak is not None, (name, torch.cuda.get_device_capability(), torch.cuda.get_device_properties(CUDA))
