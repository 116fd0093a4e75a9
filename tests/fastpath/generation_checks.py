"""The checks test_generations.py runs against one transformers release, in a process of its own.

    PYTHONPATH=/dir/with/transformers-X:. python -m tests.fastpath.generation_checks 5.21.1

What must hold on every release of the supported range, on a CPU with fla installed: the probe reports what
transformers chose at import; `fastpath.enable` reroutes every call of every Gated DeltaNet layer to the torch
reference without changing a logit; `disable` puts transformers' choice back; an untouched model goes through
`flashdraft.speculative.generate` (plain loop and engine) token for token as its own greedy decoding (the entry point
makes it runnable, and the cache rollback is exact with this release's cache); target capture equals
`output_hidden_states`. Prints "OK" last.
"""

from __future__ import annotations

import sys

import torch
import transformers

from flashdraft import fastpath
from flashdraft.fastpath.backends import TORCH
from flashdraft.fastpath.patch import (
    INSTANCE,
    entry_points,
    is_patched,
    linear_attention_layers,
    transformers_checks_devices,
)
from flashdraft.target.tiny import HYBRID_FAMILIES, random_tiny_model
from flashdraft.versions import cache_kwargs

from . import crashes_unpatched_on_cpu, expected_generation, torch_reference_logits


def binds_fla_at_import() -> bool | None:
    """Whether transformers binds fla's kernels at import on a machine without a GPU: 5.14 asks for CUDA first (no);
    5.15 and 5.16 look fla's ops up from its package root, where they are found only when `fla.ops` was imported
    before the modeling module (None: either); 5.17+ import the submodule (yes)."""
    minor = int(transformers.__version__.split(".")[1])
    return None if minor in (15, 16) else minor >= 17


def lookups(model) -> dict[tuple[int, str], object]:
    """What every linear-attention layer calls, keyed by (owner, name)."""
    return {
        (id(owner), name): getattr(owner, name)
        for _, layer in linear_attention_layers(model)
        for owner, name in entry_points(layer).values()
    }


def check_fast_path(family: str) -> None:
    model = random_tiny_model(family, num_layers=4, seed=3)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(4))
    before = lookups(model)
    expected = torch_reference_logits(model, ids)

    # What transformers chose at import, per layer.
    untouched = fastpath.probe(model)
    assert untouched.generation == expected_generation(), untouched.generation
    assert not untouched.ok and len(untouched.layers) == 3, untouched
    if binds_fla_at_import() is not None and not transformers_checks_devices():
        assert crashes_unpatched_on_cpu(model) == binds_fla_at_import(), transformers.__version__
    if crashes_unpatched_on_cpu(model):
        # 5.15-5.24 keep fla's kernels, chosen at import because fla imports; on a CPU they crash.
        assert "active drivers" in untouched.error, untouched.error
    else:
        assert not untouched.error, untouched.error
        assert all(u.impl == TORCH for layer in untouched.layers for u in layer.ops.values()), untouched

    report = fastpath.enable(model, strict=False)
    assert report.generation == expected_generation() and not report.error, report
    for layer in report.layers:
        for op, use in layer.ops.items():
            assert use.impl == TORCH and "no CUDA device" in use.reason, (layer.index, op, use)
    with torch.no_grad():
        got = model(ids).logits
    # 5.14 ran nn.Conv1d where the patched layer runs flashdraft's torch conv: the same sums in another order.
    tolerance = dict(rtol=1e-5, atol=1e-6) if report.generation == INSTANCE else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, expected, **tolerance)

    fastpath.disable(model)
    assert not is_patched(model)
    assert lookups(model) == before
    again = fastpath.probe(model)
    assert again.error == untouched.error
    assert [layer.ops for layer in again.layers] == [layer.ops for layer in untouched.layers]


@torch.inference_mode()
def own_greedy(target, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The target's own greedy decoding with transformers' cache, one token per forward."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    out = target(prompt, use_cache=True, **cache_kwargs(cache))
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = target(torch.tensor([[token]]), use_cache=True, **cache_kwargs(cache))
    return tokens


def check_spec_and_capture() -> None:
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.speculative import generate
    from flashdraft.target import FrozenTarget

    target = random_tiny_model("qwen3_5", num_layers=8, seed=5, dtype=torch.float64)
    fastpath.disable(target)  # transformers' import-time choice, as a fresh process has it
    torch.manual_seed(6)
    drafter = DFlashDraftModel.from_target(target.config, num_layers=1, block_size=4, mask_token_id=255)
    drafter = drafter.to(torch.float64).eval()
    prompt = torch.randint(0, 255, (1, 13), generator=torch.Generator().manual_seed(7))
    # A random drafter is mostly rejected: nearly every round restores the hybrid cache's snapshot.
    plain = generate(target, drafter, prompt, 30, engine=False)
    assert is_patched(target)
    engine = generate(target, drafter, prompt, 30, engine=True)
    expected = own_greedy(target, prompt, 30)
    assert plain.tokens == expected, (plain.tokens, expected)
    assert engine.tokens == expected, (engine.tokens, expected)
    assert plain.num_rounds > 5

    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    frozen = FrozenTarget.from_model(target, [1, 3, 6], strict=False)
    features = frozen.capture(prompt)
    reference = torch.cat([hidden[i + 1] for i in (1, 3, 6)], dim=-1)
    torch.testing.assert_close(features, reference, rtol=1e-12, atol=1e-12)


def main(argv: list[str]) -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    if argv:
        assert transformers.__version__ == argv[0], f"expected transformers {argv[0]}, got {transformers.__version__}"
    torch.set_num_threads(1)
    for family in HYBRID_FAMILIES:
        check_fast_path(family)
    check_spec_and_capture()
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1:])
