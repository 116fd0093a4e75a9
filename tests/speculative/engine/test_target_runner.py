"""The engine's target forwards equal transformers' forward of the whole sequence without a cache, through
prefill, decode steps, verifications and commits of every length (the exact hybrid rollback)."""

import pytest
import torch

from flashdraft.speculative.engine import ops
from flashdraft.speculative.engine.target_runner import TargetEngine, unsupported_reason
from flashdraft.target.tiny import random_tiny_model
from flashdraft.versions import cache_kwargs

from .. import one_thread, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from . import ATOL, CONFIGS, HostReads

FAMILIES = ["qwen3_5", "qwen3"]


@torch.inference_mode()
def _reference_logits(target, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of every position from `prompt - 1` on, by transformers.

    On the CPU (float64): one forward of the whole sequence without a cache, exact. On a GPU: one cached forward
    per token (fla's fused recurrent kernel, float32 arithmetic), as the engine runs a prompt this short: a
    multi-token forward would run fla's chunk kernel, whose TF32 matmuls would blur the comparison.
    """
    if ids.device.type == "cpu":
        return target(ids[None]).logits[0, prompt - 1 :].to(torch.float64)
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    rows = [target(ids[None, i : i + 1], use_cache=True, **cache_kwargs(cache)).logits[0] for i in range(len(ids))]
    return torch.cat(rows[prompt - 1 :]).to(torch.float64)


def _engine(target, graphs: bool, **kwargs) -> TargetEngine:
    engine = TargetEngine(target, **kwargs)
    if graphs:
        engine.capture()
    return engine


# 2100: caches long enough to be attended in chunks (ops.cached_attention's split over slots). pad_to: the prompt
# prefilled padded (what a captured prefill replays): 64 stays under SHORT_PREFILL (fla's fused recurrent kernel on
# a GPU), 100 goes past it (the chunk kernel).
@pytest.mark.parametrize(
    "max_len, pad_to", [(128, None), (128, 64), (128, 100), (2100, None)], ids=["short", "pad64", "pad100", "chunked"]
)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_step_equals_a_full_forward_without_cache(family, config, max_len, pad_to):
    """prefill -> decode -> verify/commit with keep 1..bs in turn -> decode: each logit row equals the row of a
    no-cache forward of the tokens so far (so the caches hold exactly the kept tokens, and a padded prefill leaves
    nothing of its padding where it is seen)."""
    device, dtype, graphs = config
    target = tiny_target(family, seed=1, dtype=dtype).to(device)
    bs = 5
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (120,), generator=g).to(device)
    n = prompt = 37  # odd prompt length; the cache holds tokens [0, n)
    with ready(target):
        expected = _reference_logits(target, ids, prompt)
        engine = _engine(target, graphs, max_len=max_len, block_size=bs)
        assert (engine.slots % ops.ATTENTION_CHUNK == 0) == (max_len > ops.CHUNKED_FROM)
        atol = ATOL[dtype] * max(1.0, float(expected.abs().max()))

        def check(got, first, what):
            rows = expected[first - (prompt - 1) : first - (prompt - 1) + got.shape[0]]
            err = (got.double() - rows.to(got.device)).abs().max().item()
            assert err <= atol, f"{what}: max error {err:.3g} > {atol:.3g}"

        check(engine.prefill(ids[:n], pad_to=pad_to)[None], n - 1, "prefill")
        assert engine.prefill_padded_width == pad_to and int(engine.length) == n
        for _ in range(3):
            engine.decode_ids.fill_(int(ids[n]))
            engine.decode()
            check(engine.decode_logits, n, f"decode at {n}")
            n += 1
        # Each verification is fed the true next tokens; keeping k of them must leave the cache at n + k.
        for keep in [1, 2, bs, 3, bs - 1, 1, bs, 2]:
            engine.verify_ids.copy_(ids[n : n + bs])
            engine.verify()
            check(engine.verify_logits, n, f"verify at {n}")
            engine.keep.fill_(keep)
            engine.commit()
            engine.note_committed(keep)
            n += keep
            engine.decode_ids.fill_(int(ids[n]))
            engine.decode()
            check(engine.decode_logits, n, f"decode after keeping {keep}")
            n += 1
        assert engine.num_tokens == n and int(engine.length) == n


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_features_are_the_hidden_states_of_the_feature_layers(family):
    target = tiny_target(family, seed=3)
    ids = torch.randint(0, 256, (1, 9))
    with ready(target), torch.inference_mode():
        hidden = target(ids, output_hidden_states=True).hidden_states
        engine = TargetEngine(target, max_len=32, block_size=4, feature_layers=[0, 2])
        engine.prefill(ids[0])
        expected = torch.cat([hidden[1][0], hidden[3][0]], dim=-1)
        torch.testing.assert_close(engine.prompt_features, expected, rtol=0, atol=1e-12)
        # A verification of the next tokens yields their features.
        more = torch.randint(0, 256, (1, 4))
        hidden = target(torch.cat([ids, more], 1), output_hidden_states=True).hidden_states
        engine.verify_ids.copy_(more[0])
        engine.verify()
        expected = torch.cat([hidden[1][0, 9:], hidden[3][0, 9:]], dim=-1)
        torch.testing.assert_close(engine.features, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_padded_prefill_reads_nothing_on_the_host_and_keeps_the_prompts_features(family):
    """What a GPU captures for a prompt, the padded prefill, reads no device value on the host (`HostReads`), and
    leaves the prompt's features and final hidden states as the unpadded prefill does."""
    target = tiny_target(family, seed=3)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    exact = TargetEngine(target, max_len=32, block_size=4, feature_layers=[0, 2])
    logits = exact.prefill(ids)
    engine = TargetEngine(target, max_len=32, block_size=4, feature_layers=[0, 2])
    engine.prefill_keep.fill_(9)
    engine._prefill_buffers()
    engine.prefill_ids[:9].copy_(ids)
    with HostReads() as reads:
        engine._prefill_step(16).fn()
    assert reads.found == []
    torch.testing.assert_close(engine.prefill(ids, pad_to=16), logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(engine.prompt_features, exact.prompt_features, rtol=0, atol=1e-12)
    torch.testing.assert_close(engine.prompt_hidden, exact.prompt_hidden, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="pads to 9 .. 36"):
        engine.prefill(ids, pad_to=8)


def test_a_captured_engine_captures_a_prefill_width_the_second_time_it_is_needed(monkeypatch):
    """A one-off prompt length is prefilled eagerly (a capture costs several prefills); the second prompt of that
    padded width, and every width `capture_prefill` records ahead, replays a graph. (On the CPU the captures are
    recorded, not made: the steps run eagerly.)"""
    from flashdraft.speculative.engine import graphs

    captured = []
    monkeypatch.setattr(TargetEngine, "captured", property(lambda self: True))
    monkeypatch.setattr(graphs.Step, "capture", lambda step, pool=None: captured.append(step.name))
    monkeypatch.setattr(TargetEngine, "prefill_pool", lambda self: None)
    target = tiny_target("qwen3_5", seed=3)
    engine = TargetEngine(target, max_len=300, block_size=4)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5))
    widths = []
    for length in (50, 9, 70, 64, 65):
        engine.prefill(ids[:length])
        widths.append(engine.prefill_padded_width)
    assert widths == [None, 64, None, 64, 128] and captured == ["prefill 64", "prefill 128"]
    engine.capture_prefill([200, 130, 3000, 210])  # 3000: more than the engine holds
    assert captured == ["prefill 64", "prefill 128", "prefill 192", "prefill 256"]


def test_unsupported_targets_are_named():
    moe = random_tiny_model("qwen3_5_moe")
    assert "MoE" in unsupported_reason(moe)
    with pytest.raises(ValueError, match="cannot run this target"):
        TargetEngine(moe, max_len=16, block_size=4)
    assert unsupported_reason(random_tiny_model("qwen3_5")) is None
    assert unsupported_reason(random_tiny_model("qwen3")) is None


def test_bad_arguments():
    target = tiny_target("qwen3", seed=0)
    engine = TargetEngine(target, max_len=8, block_size=4)
    with pytest.raises(ValueError, match="max_len"):
        engine.prefill(torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match="feature_layers"):
        TargetEngine(target, max_len=8, block_size=4, feature_layers=[7])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA target"):
            engine.capture()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA configuration runs these kernels for real")
def test_the_gpu_conv_kernels_roll_back_exactly_too(monkeypatch):
    """The engine's GPU conv path (flashdraft's Triton conv with initial states, and its one-token update), run
    under the Triton interpreter in float32: same logits as transformers through decode, verify and commit."""
    import importlib.util
    from pathlib import Path

    from flashdraft.speculative.engine import ops

    # tests/kernels/conftest.py imports an interpreted copy of flashdraft.kernels (and leaves the real one alone).
    spec = importlib.util.spec_from_file_location(
        "_kernels_conftest", Path(__file__).parents[2] / "kernels/conftest.py"
    )
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    KERNELS = conftest.KERNELS
    monkeypatch.setattr(ops, "_triton_conv", lambda x: True)
    monkeypatch.setattr(ops, "_kernels", lambda: KERNELS)
    target = tiny_target("qwen3_5", seed=1, dtype=torch.float32)
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(2))
    with ready(target), torch.inference_mode():
        expected = target(ids[None]).logits[0]
        engine = TargetEngine(target, max_len=64, block_size=5)
        n = 17
        torch.testing.assert_close(engine.prefill(ids[:n]), expected[n - 1], rtol=0, atol=1e-5)
        for keep in [1, 3, 5, 2]:
            engine.decode_ids.fill_(int(ids[n]))
            engine.decode()
            torch.testing.assert_close(engine.decode_logits[0], expected[n], rtol=0, atol=1e-5)
            n += 1
            engine.verify_ids.copy_(ids[n : n + 5])
            engine.verify()
            torch.testing.assert_close(engine.verify_logits, expected[n : n + 5], rtol=0, atol=1e-5)
            engine.keep.fill_(keep)
            engine.commit()
            engine.note_committed(keep)
            n += keep


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
@torch.no_grad()
def test_the_captured_steps_read_nothing_on_the_host(arch):
    """Decode, verify and commit (the hybrid state's rollback included) are what a GPU captures in CUDA graphs: their
    eager runs on the CPU, under `HostReads`, read no device value on the host."""
    engine = TargetEngine(tiny_target(arch, seed=5, dtype=torch.float32), max_len=64, block_size=5, feature_layers=[1])
    engine.prefill(torch.randint(0, 200, (11,), generator=torch.Generator().manual_seed(0)))
    engine.verify_ids.random_(0, 200)
    engine.keep.fill_(3)
    found = {}
    for name in ("decode", "verify", "commit"):
        with HostReads() as reads:
            engine.steps[name].fn()
        found[name] = reads.found
    assert found == {"decode": [], "verify": [], "commit": []}
    assert int(engine.length) == 11 + 1 + 3
