"""Device and dtype settings: "auto" follows the machine; a missing GPU is an error naming the setting."""

import pytest
import torch

from flashdraft.devices import autocast, resolve_device, resolve_dtype


def test_auto_follows_the_machine(monkeypatch):
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        device = resolve_device("auto")
        assert device.type == ("cuda" if cuda else "cpu")
        assert resolve_dtype("auto", device) == (torch.bfloat16 if cuda else torch.float32)
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_a_gpu_names_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"train\.device = cuda, but no CUDA device"):
        resolve_device("cuda", field="train.device")


def test_autocast_is_bf16_on_the_gpu_only():
    with autocast(torch.device("cpu")):
        a = torch.ones(2, 2)
        assert (a @ a).dtype == torch.float32
    ctx = autocast(torch.device("cuda"))
    assert ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
