"""The naive DFlash training step: the anchor bench.train_step measures flashdraft against, as a function.

What a straightforward trainer does with the recipe: the target's hidden states via `output_hidden_states` on the
HF model (all of them held), a 5-layer drafter with the target's sizes in plain bf16, a dense boolean mask with SDPA
(K/V repeated to the query heads), full-vocabulary logits and plain cross-entropy, fused AdamW; the target runs fla's
delta rule and fla's conv (`bench.anchors.fla_kernels`), so the anchor is not slowed by transformers' torch
fallbacks. The sizes come from `Dims` (so `--smoke` runs it tiny on a CPU), and the step calls `mark(phase)` at the
phase boundaries of `flashdraft.benchmarks.train_step`: the loss and its backward are timed apart from the drafter's
backward by differentiating the loss with respect to a detached copy of the drafter output first (the same kernels
run; only the order of the two backward halves is fixed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Dims:
    hidden: int = 5120
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    ffn: int = 17408
    vocab: int = 248320
    layer_ids: tuple[int, ...] = (1, 16, 31, 46, 61)
    block_size: int = 16
    anchors: int = 512
    drafter_layers: int = 5
    rope_theta: float = 1e7


class RMS(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.w


def rope(x, pos, theta):
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    f = pos.float()[:, None] * inv[None]
    cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class DraftLayer(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d_ = d
        H, NH, NKV, HD, FF = d.hidden, d.heads, d.kv_heads, d.head_dim, d.ffn
        self.q = nn.Linear(H, NH * HD, bias=False)
        self.k = nn.Linear(H, NKV * HD, bias=False)
        self.v = nn.Linear(H, NKV * HD, bias=False)
        self.o = nn.Linear(NH * HD, H, bias=False)
        self.qn, self.kn = RMS(HD), RMS(HD)
        self.n1, self.n2 = RMS(H), RMS(H)
        self.g = nn.Linear(H, FF, bias=False)
        self.u = nn.Linear(H, FF, bias=False)
        self.d = nn.Linear(FF, H, bias=False)

    def forward(self, x, ctx, qpos, kpos, mask):
        NH, NKV, HD, theta = self.d_.heads, self.d_.kv_heads, self.d_.head_dim, self.d_.rope_theta
        h = self.n1(x)
        T, C = h.shape[0], ctx.shape[0]
        q = self.qn(self.q(h).view(T, NH, HD))
        q = rope(q.transpose(0, 1), qpos, theta)
        kv_in = torch.cat([ctx, h], 0)
        k = self.kn(self.k(kv_in).view(C + T, NKV, HD))
        k = rope(k.transpose(0, 1), kpos, theta)
        v = self.v(kv_in).view(C + T, NKV, HD).transpose(0, 1)
        k = k.repeat_interleave(NH // NKV, 0)
        v = v.repeat_interleave(NH // NKV, 0)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]
        x = x + self.o(a.transpose(0, 1).reshape(T, NH * HD))
        h = self.n2(x)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


class Drafter(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.fc = nn.Linear(len(d.layer_ids) * d.hidden, d.hidden, bias=False)
        self.hn = RMS(d.hidden)
        self.layers = nn.ModuleList(DraftLayer(d) for _ in range(d.drafter_layers))
        self.norm = RMS(d.hidden)

    def forward(self, noise, feats, qpos, kpos, mask):
        ctx = self.hn(self.fc(feats))
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, qpos, kpos, mask)
        return self.norm(x)


def make_step(target, drafter, optimizer, d: Dims, seq: int, device: str | torch.device, generator=None):
    """A closure `step(mark)` running one naive training step on a fresh random sequence of `seq` tokens."""
    emb, head = target.model.embed_tokens.weight, target.lm_head.weight
    H, BS, ANCH, V = d.hidden, d.block_size, d.anchors, d.vocab

    def step(mark):
        ids = torch.randint(0, V - 1, (1, seq), device=device, generator=generator)
        anchors = torch.sort(torch.randperm(seq - BS - 1, device=device, generator=generator)[:ANCH] + 1).values
        with torch.no_grad():
            out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            feats = torch.cat([out.hidden_states[i + 1][0] for i in d.layer_ids], -1)
            del out
        mark("target")
        blk = torch.full((ANCH, BS), V - 1, device=device, dtype=torch.long)
        blk[:, 0] = ids[0, anchors]
        noise = F.embedding(blk.view(-1), emb)
        qpos = (anchors[:, None] + torch.arange(BS, device=device)[None]).view(-1)
        kpos = torch.cat([torch.arange(seq, device=device), qpos])
        bid = torch.arange(ANCH, device=device).repeat_interleave(BS)
        ctx_ok = torch.arange(seq, device=device)[None, :] < anchors[bid][:, None]
        blk_ok = bid[:, None] == bid[None, :]
        mask = torch.cat([ctx_ok, blk_ok], 1)
        hid = drafter(noise, feats, qpos, kpos, mask).view(ANCH, BS, H)[:, 1:]
        mark("drafter_fwd")
        leaf = hid.detach().requires_grad_()
        pos = (anchors[:, None] + torch.arange(1, BS, device=device)[None]).clamp(max=seq - 1)
        labels = ids[0, pos]
        logits = (leaf.reshape(-1, H) @ head.t()).float()
        w = torch.exp(-(torch.arange(BS - 1, device=device, dtype=torch.float32)) / 7.0).repeat(ANCH)
        loss = (F.cross_entropy(logits, labels.reshape(-1), reduction="none") * w).sum() / w.sum()
        loss.backward()
        del logits
        mark("loss")
        hid.backward(leaf.grad)
        mark("drafter_bwd")
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer")

    return step
