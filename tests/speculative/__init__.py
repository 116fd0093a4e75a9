"""Tests of flashdraft.speculative, and the helpers they share (tiny targets and drafters).

transformers' torch reference of the gated delta rule computes in float32 even for a float64 model, which
limits any comparison to ~1e-8. `exact_targets` therefore also installs a float64 delta rule (`exact_delta_rule`,
the textbook recurrence in the input's dtype) so that "exact" can mean ≤ 1e-10.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashdraft import fastpath
from flashdraft.fastpath.backends import CHUNK_RULE, RECURRENT_RULE
from flashdraft.fastpath.patch import entry_points, linear_attention_layers
from flashdraft.target.tiny import random_tiny_model
from flashdraft.versions import cache_kwargs

VOCAB = 256
MASK = VOCAB - 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine two threads cost up to 50x per op.

    Imported by every test module here (a fixture in the module's namespace is collected).
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def exact_delta_rule(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_
):
    """Gated delta rule, token by token, in the dtype of `value`; `[B, T, H, K]` inputs as transformers passes.

    From transformers 5.23 the layer passes fewer query/key heads than value heads (each serves consecutive value
    heads, as in fla); before, it repeated them itself.
    """
    groups = value.shape[2] // key.shape[2]
    query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    q, k, v, b, g = (x.transpose(1, 2) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, heads, length, k_dim = k.shape
    s = torch.zeros(batch, heads, k_dim, v.shape[-1], dtype=v.dtype) if initial_state is None else initial_state
    s = s.to(v.dtype)
    out = torch.empty_like(v)
    for t in range(length):
        s = s * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])) * b[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, t])
    return out.transpose(1, 2), (s if output_final_state else None)


# Marked as one of flashdraft's own backends, so that `fastpath.ensure` (which every decoding entry point calls)
# leaves it in place instead of patching the layer back to the float32 torch fallback.
exact_delta_rule.__flashdraft_backend__ = True


def tiny_target(family: str, dtype=torch.float64, seed: int = 0, **kwargs):
    """A tiny random target; MoE families use the eager experts (grouped_mm has no float64)."""
    target = random_tiny_model(family, dtype=dtype, seed=seed, **kwargs)
    if family in ("qwen3_5_moe", "qwen3_next"):
        target.set_experts_implementation("eager")
    return target


@contextlib.contextmanager
def ready(*targets, exact: bool = True):
    """Enable the fast path (torch fallback on a CPU) on hybrid targets; with `exact`, the float64 delta rule.

    Everything patched is put back on exit, so other test modules see transformers' import-time state.
    """
    patched: list[tuple[object, str, object]] = []
    hybrids = [t for t in targets if linear_attention_layers(t)]
    try:
        for target in hybrids:
            fastpath.enable(target, strict=False, run_probe=False)
            if exact and next(target.parameters()).dtype == torch.float64:
                # Where the layers look the rules up: module globals (5.15+) or each layer's attributes (5.14).
                for _, layer in linear_attention_layers(target):
                    for op in (CHUNK_RULE, RECURRENT_RULE):
                        owner, name = entry_points(layer)[op]
                        patched.append((owner, name, getattr(owner, name)))
                        setattr(owner, name, exact_delta_rule)
        yield targets
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
        for target in hybrids:
            fastpath.disable(target)


# A small selector: a vocabulary of 8 keeps 3 candidates per position, so the proposal's support is narrower than the
# backbone's; a group size that divides the tiny targets' hidden sizes.
DFLASH2_FIELDS = {"conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}


def random_drafter(target, block_size: int = 16, num_layers: int = 1, seed: int = 0, family: str = "dflash", **fields):
    """A randomly initialised drafter of `family` for `target`, in the target's dtype. A DSpark drafter's Markov
    head is scaled up so that its bias changes what it drafts (a freshly initialised one adds almost nothing); a
    DFlash2 drafter's convolutions and selector are drawn at random (fresh ones are the identity and S = U)."""
    from flashdraft.drafter import DFlashDraftModel

    torch.manual_seed(seed)
    mask = target.config.vocab_size - 1
    drafter = DFlashDraftModel.from_target(
        target.config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=mask,
        family=family,
        family_fields={"dspark": {"markov_rank": 8, **fields}, "dflash2": {**DFLASH2_FIELDS, **fields}}.get(family),
    )
    if drafter.markov_head is not None:
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.mul_(40)
            drafter.markov_head.markov_w2.weight.mul_(40)
    if drafter.candidate_selector is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name:
                    p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                elif "candidate_selector" in name:
                    p.copy_(3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return drafter.to(next(target.parameters()).dtype).eval()


class ScriptedDrafter(torch.nn.Module):
    """Drafts a known continuation (e.g. the target's own greedy output), wrong at a chosen rate.

    Duck-types the drafter interface the decoding loop uses: the forward returns each block position as its
    "hidden state", and `compute_logits` turns a position into a peaked distribution on `script[position]`
    (or on another token, with probability `error_rate`), so acceptance lengths span 0 .. bs - 1.
    """

    def __init__(self, script: list[int], vocab: int, block_size: int, error_rate: float = 0.0, seed: int = 0):
        super().__init__()
        self.script, self.vocab, self.block_size, self.error_rate = list(script), vocab, block_size, error_rate
        self.mask_token_id, self.target_layer_ids = MASK % vocab, [0]
        self.draft_offset, self.markov_head = 0, None  # a DFlash drafter's block convention, no sequential head
        self.scale = torch.nn.Parameter(torch.tensor(8.0, dtype=torch.float64), requires_grad=False)
        self.rng = torch.Generator().manual_seed(seed)

    def forward(self, position_ids, noise_embedding=None, target_hidden=None, past_key_values=None, **_):
        block = position_ids[:, -noise_embedding.shape[1] :]
        return block[..., None].to(self.scale.dtype)

    def compute_logits(self, hidden, lm_head):
        positions = hidden[..., 0].long().tolist()
        tokens = [self.script[p] if p < len(self.script) else 0 for p in positions]
        wrong = torch.rand(len(tokens), generator=self.rng) < self.error_rate
        tokens = [(t + 1) % self.vocab if w else t for t, w in zip(tokens, wrong.tolist(), strict=True)]
        logits = torch.zeros(len(tokens), self.vocab, dtype=self.scale.dtype)
        logits[torch.arange(len(tokens)), torch.tensor(tokens)] = self.scale
        return logits


@torch.inference_mode()
def reference_greedy(target, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """The target's own greedy decoding: transformers' cache, one token per forward (an independent path).

    The prompt too goes in token by token: on a GPU a multi-token forward of a hybrid target runs fla's chunk
    kernel, whose TF32 matmuls would blur a float32 comparison; one token at a time is plain float32 arithmetic.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    out, ids = [], prompt.view(1, -1)
    for i in range(ids.shape[1] - 1):
        target(ids[:, i : i + 1], use_cache=True, **cache_kwargs(cache))
    ids = ids[:, -1:]
    for _ in range(max_new_tokens):
        token = int(target(ids, use_cache=True, **cache_kwargs(cache)).logits[0, -1].argmax())
        out.append(token)
        if token in stop_token_ids:
            break
        ids = torch.tensor([[token]], device=prompt.device)
    return out


@contextlib.contextmanager
def recorded_forwards(target):
    """Records every cached forward of `target` while open: (tokens already in the cache, fed ids, logits)."""
    from flashdraft.speculative import rollback

    records, starts = [], []

    def before(module, args, kwargs):
        # transformers 5.24 renamed the forward's `past_key_values` to `cache`; the loop passes whichever it takes.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        starts.append(rollback.kv_length(cache) if cache is not None else 0)

    def after(module, args, kwargs, output):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        records.append((starts.pop(), ids[0].clone(), output.logits[0].clone()))

    handles = [
        target.register_forward_pre_hook(before, with_kwargs=True),
        target.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def verification_error(target, records, tokens: list[int]) -> float:
    """Largest |logit| difference between each recorded cached forward and a forward without cache over the same
    tokens (`tokens`: the correct sequence, whose first `start` tokens each recorded forward's cache holds).

    Greedy output alone cannot show a slightly wrong cache (a recurrent state rolled back imperfectly moves
    logits by ~1e-3, rarely enough to change an argmax of a tiny random target); this can, to rounding."""
    worst = 0.0
    device = next(target.parameters()).device
    for start, ids, logits in records:
        full = torch.cat([torch.tensor(tokens[:start], dtype=torch.long, device=device), ids.to(device)])
        reference = target(full[None]).logits[0, -logits.shape[0] :]
        worst = max(worst, (logits - reference).abs().max().item())
    return worst
