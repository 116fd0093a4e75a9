"""Shipped autotuning choices (flashdraft/kernels/tuned.py): Triton's cache files in, a shipped file out, and an
autotuner that runs the shipped config without timing any, only where kernel, key and config all match."""

from __future__ import annotations

import json

import pytest
import torch
import triton
import triton.language as tl

from flashdraft.kernels import tuned

CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1, num_stages=1), triton.Config({"BLOCK": 32}, num_warps=2)]


def toy_kernel(out_ptr, n, BLOCK: tl.constexpr):
    """Writes its BLOCK: what it returns is the config it ran."""
    tl.store(out_ptr + tl.arange(0, 1), tl.full((1,), BLOCK, tl.int32))


def toy_autotuner():
    # Decorated here, not at import: TRITON_INTERPRET is read then (set by the test that runs it on a CPU).
    return triton.autotune(CONFIGS, key=["n"])(triton.jit(toy_kernel))


def triton_cache_file(tmp_path, name, key, timings):
    """A `<kernel>.autotune.json` as Triton writes it: the key and each config's [median, p20, p80] ms."""
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}" / f"{name}.autotune.json"
    path.parent.mkdir()
    rows = [[{**c.__dict__, "pre_hook": None}, t] for c, t in zip(CONFIGS, timings, strict=True)]
    path.write_text(json.dumps({"key": key, "configs_timings": rows}))
    return path


def test_export_keeps_each_keys_fastest_config_and_the_kept_entries(tmp_path):
    files = [
        triton_cache_file(tmp_path, "toy_kernel", [8, "torch.int32"], [[0.9, 0.8, 1.0], [0.5, 0.4, 0.6]]),
        triton_cache_file(tmp_path, "toy_kernel", [64, "torch.int32"], [[0.3, 0.2, 0.4], [0.5, 0.4, 0.6]]),
    ]
    kept = {"other_kernel": [{"key": [1], "config": tuned.describe(CONFIGS[0])}]}
    table = json.loads(tuned.export(files, "NVIDIA H200", "3.6.0", keep=kept))
    assert table["gpu"] == "NVIDIA H200" and table["triton"] == "3.6.0"
    assert table["kernels"]["other_kernel"] == kept["other_kernel"]
    by_key = {tuple(e["key"]): e["config"] for e in table["kernels"]["toy_kernel"]}
    assert by_key == {(8, "torch.int32"): tuned.describe(CONFIGS[1]), (64, "torch.int32"): tuned.describe(CONFIGS[0])}


def test_kernel_configs_merges_files_of_one_gpu_and_refuses_another(tmp_path, capsys):
    from bench import kernel_configs

    def written(name, entries, gpu="NVIDIA H200"):
        path = tmp_path / name
        path.write_text(tuned.export([], gpu, "3.6.0", keep=entries))
        return path

    small = {"toy_kernel": [{"key": [8], "config": tuned.describe(CONFIGS[0])}]}
    large = {
        "toy_kernel": [
            {"key": [8], "config": tuned.describe(CONFIGS[1])},
            {"key": [4096], "config": tuned.describe(CONFIGS[0])},
        ]
    }
    a, b = written("a.json", small), written("b.json", large)
    out = tmp_path / "out"
    assert kernel_configs.main(["--keep", str(a), "--keep", str(b), "--out", str(out)]) == 0
    table = json.loads((out / "NVIDIA_H200.json").read_text())
    by_key = {tuple(e["key"]): e["config"] for e in table["kernels"]["toy_kernel"]}
    assert table["gpu"] == "NVIDIA H200"
    assert by_key == {(8,): tuned.describe(CONFIGS[1]), (4096,): tuned.describe(CONFIGS[0])}  # the later file wins

    other = written("h100.json", small, gpu="NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit):
        kernel_configs.main(["--keep", str(a), "--keep", str(other), "--out", str(out)])
    assert "measured on 'NVIDIA H100 80GB HBM3', not 'NVIDIA H200'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        kernel_configs.main(["--keep", str(tmp_path / "bad.json")])
    assert "bad.json: not a kernel-configs file" in capsys.readouterr().err


def test_fill_places_only_matching_kernel_key_and_config():
    autotuner = toy_autotuner()
    table = {
        "toy_kernel": [
            {"key": [8, "torch.int32"], "config": tuned.describe(CONFIGS[1])},
            # Not a config this autotuner offers (another library version): never placed.
            {"key": [9, "torch.int32"], "config": {**tuned.describe(CONFIGS[1]), "num_warps": 8}},
        ],
        "another_kernel": [{"key": [10, "torch.int32"], "config": tuned.describe(CONFIGS[0])}],
    }
    assert tuned.fill(autotuner, table) == 1
    assert autotuner.cache == {(8, "torch.int32"): CONFIGS[1]}
    assert tuned.fill(autotuner, table) == 0  # once per autotuner


def test_a_filled_autotuner_runs_the_shipped_config_without_timing(monkeypatch):
    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated
    autotuner = toy_autotuner()
    monkeypatch.setattr(type(autotuner), "_bench", lambda *a, **k: pytest.fail("a shipped key was timed"))
    shipped = {"toy_kernel": [{"key": [8, "torch.int32"], "config": tuned.describe(CONFIGS[1])}]}
    assert tuned.fill(autotuner, shipped) == 1
    out = torch.zeros(1, dtype=torch.int32, device="cuda" if cuda else "cpu")
    autotuner[(1,)](out, 8)
    assert out.item() == 32  # BLOCK of the shipped config, not the first one


def test_apply_does_nothing_off_cuda_or_when_turned_off(monkeypatch):
    assert tuned.apply("cpu") == 0
    monkeypatch.setenv("FLASHDRAFT_SHIPPED_TUNING", "0")
    assert not tuned.enabled()


def test_every_shipped_file_names_its_gpu_and_kernels_that_exist():
    """Each file is the one its GPU's name maps to, and every kernel it names is an autotuned kernel of the fla
    this package is tested with, or flashdraft's conv: a rename upstream would make its entries dead weight."""
    import fla.modules  # noqa: F401 - the norms
    import fla.ops.gated_delta_rule  # noqa: F401

    files = sorted(tuned.TUNED_DIR.glob("*.json"))
    assert files, "no shipped file"
    fla_kernels = {tuned.kernel_name(a) for a in tuned._module_autotuners()}
    ours = {"causal_conv1d_fwd_kernel", "causal_conv1d_fwd_tile_kernel", "causal_conv1d_bwd_kernel"}
    ours |= {"causal_conv1d_bwd_tile_kernel"}
    for path in files:
        table = json.loads(path.read_text())
        assert tuned.gpu_file(table["gpu"]) == path
        for name, entries in table["kernels"].items():
            assert name in fla_kernels | ours, f"{path.name}: {name} is no autotuned kernel here"
            for entry in entries:
                assert set(entry["config"]) == {"kwargs", *tuned.CONFIG_FIELDS} and entry["key"], (path, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_this_gpus_file_is_placed_whole():
    """On a GPU with a shipped file, every fla entry is in its kernel's autotuner after `apply`: its configs are
    ones fla offers on this GPU (fla's config lists depend on the device)."""
    import fla.modules  # noqa: F401
    import fla.ops.gated_delta_rule  # noqa: F401

    table = tuned.load(torch.cuda.get_device_name())
    if not table:
        pytest.skip(f"no shipped file for {torch.cuda.get_device_name()}")
    tuned.apply("cuda")
    autotuners = list(tuned._module_autotuners())
    for name, entries in table.items():
        if name.startswith("causal_conv1d"):
            continue
        for entry in entries:
            assert any(tuned.kernel_name(a) == name and tuple(entry["key"]) in a.cache for a in autotuners), (
                name,
                entry["key"],
            )
