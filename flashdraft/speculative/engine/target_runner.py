"""The target, run layer by layer from its transformers modules' weights over static caches.

    engine = TargetEngine(target, max_len=4096, block_size=16, feature_layers=[1, 16, 31, 46, 61])
    engine.capture()                       # CUDA graphs of decode, verify and commit (before the caches fill)
    logits = engine.prefill(prompt_ids)    # (V,) logits of the last prompt token; features in engine.prompt_features
    engine.verify_ids.copy_(block)         # [last token, draft_1 .. draft_{bs-1}]
    engine.verify()                        # engine.verify_logits (bs, V), engine.features (bs, n * D)
    engine.keep.fill_(k + 1); engine.commit()   # keep the first k + 1 tokens of the block (exactly)
    engine.note_committed(k + 1)           # the host's count of cached tokens

Caches are preallocated for `max_len` tokens: keys/values of the full-attention layers; the conv window (last
W-1 inputs) and the recurrent state of each Gated DeltaNet layer. The number of cached tokens lives in a device
tensor (`length`), so one captured graph serves every context length.

Exact rollback: a verification reads the linear-attention states without advancing them, and `commit` advances
them over exactly the first `keep` tokens (`mixers.commit_linear` says how); the attention layers only need
`length` advanced (rows past it are masked and later overwritten). tests/speculative/engine prove the result equal
to a no-cache forward of the whole sequence.

The final-normed hidden states (the LM head's input) of the prompt and of the last verified block are kept too
(`prompt_hidden`, `verify_hidden`): the target's MTP layer reads them (`mtp_runner`).

A prompt is prefilled by one CUDA graph once the engine is captured: the prompt padded to the next multiple of
PREFILL_QUANTUM tokens (one graph per such width, captured when a second prompt needs it or ahead by
`capture_prefill`), its true length in a device tensor. Past it the padding is inert: the delta rule steps with
beta = 0 and decay 1, the conv window and `length` stop at the prompt, and keys written past it stay masked until
overwritten. Eagerly a prefill costs a launch per kernel (tens of milliseconds for a small target, whatever its
length). Prompts longer than PREFILL_GRAPH_MAX run eagerly: their compute outweighs the launches.

On a GPU the commit runs on a side stream: nothing the drafter computes next depends on it, so it overlaps the
next draft; the next decode, verify or prefill waits for it (`join`).

Supported: dense-MLP Qwen3.5 (Gated DeltaNet + gated full attention) and Qwen3 targets; `unsupported_reason`
names what else is found. The MLPs, norms and projections are the model's own modules.
"""

from __future__ import annotations

import torch

from flashdraft.fastpath.backends import gated_norm_forward
from flashdraft.speculative.engine import ops
from flashdraft.speculative.engine.graphs import Step, capture_all, capture_or_warn
from flashdraft.speculative.engine.mixers import LinearStates, attention, commit_linear, linear_attention

# Prompts are prefilled padded to a multiple of this (one graph per width) up to PREFILL_GRAPH_MAX tokens.
PREFILL_QUANTUM = 64
PREFILL_GRAPH_MAX = 2048

_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def text_model(target: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM, multimodal wrappers included."""
    inner = getattr(target, "model", None)
    inner = getattr(inner, "language_model", inner)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"{type(target).__name__}: no decoder stack found (expected target.model.layers)")
    return inner


def unsupported_reason(target: torch.nn.Module) -> str | None:
    """Why the engine cannot run `target`, or None if it can."""
    try:
        inner = text_model(target)
    except ValueError as exc:
        return str(exc)
    config = inner.config
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(inner.layers))
    bad_types = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad_types:
        return f"layer types {bad_types} (the engine runs full attention and Gated DeltaNet layers)"
    if target.get_output_embeddings() is None:
        return "no LM head"
    for i, layer in enumerate(inner.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, p) for p in _MLP_PARTS):
            return f"layer {i}: {type(mlp).__name__} is not a dense gate/up/down MLP (MoE layers are not supported)"
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        parts = _GDN_PARTS if hasattr(layer, "linear_attn") else _ATTN_PARTS
        if mixer is None or not all(hasattr(mixer, p) for p in parts):
            return f"layer {i}: {type(mixer).__name__} has not the parts {parts}"
    return None


class TargetEngine:
    """Prefill, decode, verify and commit of a target over static caches (see the module docstring).

    max_len: most tokens the caches hold (prompt + generated); block_size: tokens per verification;
    feature_layers: target layers whose outputs `verify` / `prefill` keep as drafter context features.
    """

    # Commit on a side stream, overlapping the next draft (GPU only; a switch for benchmarks' A/B runs).
    overlap_commit = True

    def __init__(
        self,
        target: torch.nn.Module,
        max_len: int,
        block_size: int,
        feature_layers: list[int] | None = None,
    ):
        reason = unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"the engine cannot run this target: {reason}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.target = target
        self.inner = text_model(target)
        self.lm_head = target.get_output_embeddings()
        self.layers = list(self.inner.layers)
        # Every RMSNorm, fused on the GPU (ops.Norm); keyed by module.
        self.norms = {
            id(m): ops.Norm(m)
            for m in target.modules()
            if "RMSNorm" in type(m).__name__ and "Gated" not in type(m).__name__
        }
        first = next(target.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.block_size = block_size
        # Room for a whole verified block after the last committed token.
        self.max_len = max_len
        self.slots = ops.attention_slots(max_len + block_size)
        self.feature_layers = sorted(feature_layers or [])
        if any(not 0 <= i < len(self.layers) for i in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers} outside the target's {len(self.layers)} layers")
        dev, dt = self.device, self.dtype
        state_dtype = torch.float64 if dt == torch.float64 else torch.float32
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        linear = {i: layer.linear_attn for i, layer in enumerate(self.layers) if hasattr(layer, "linear_attn")}
        # The layers' gated output norms as one fla kernel on the GPU whether or not fastpath.enable() ran.
        self.gated_norms = {i: gated_norm_forward(m.norm) for i, m in linear.items()}
        self.linear = LinearStates(linear, block_size, dt, state_dtype, dev) if linear else None
        for i, layer in enumerate(self.layers):
            if not hasattr(layer, "linear_attn"):
                attn = layer.self_attn
                kv_heads = attn.k_proj.out_features // attn.head_dim
                shape = (kv_heads, self.slots, attn.head_dim)
                self.kv[i] = (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
        self.cos, self.sin = ops.rope_table(self.inner.rotary_emb, self.slots, dt, dev)
        self.slot_index = torch.arange(self.slots, device=dev)
        self.block_index = torch.arange(block_size, device=dev)
        vocab = self.lm_head.out_features
        width = len(self.feature_layers) * self.inner.config.hidden_size
        # Static inputs and outputs of the steps.
        self.length = torch.zeros((), dtype=torch.long, device=dev)
        self.keep = torch.ones((), dtype=torch.long, device=dev)
        self.decode_ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.verify_ids = torch.zeros(block_size, dtype=torch.long, device=dev)
        self.decode_logits = torch.zeros(1, vocab, dtype=dt, device=dev)
        self.verify_logits = torch.zeros(block_size, vocab, dtype=dt, device=dev)
        self.features = torch.zeros(block_size, width, dtype=dt, device=dev)
        self.prompt_features: torch.Tensor | None = None
        # Final-normed hidden states (the LM head's input) of the verified block and of the prompt: what the
        # target's MTP layer reads (mtp_runner).
        self.verify_hidden = torch.zeros(block_size, self.inner.config.hidden_size, dtype=dt, device=dev)
        self.prompt_hidden: torch.Tensor | None = None
        # The prompt's length on the device (a prefill's inputs past it are padding), and the padded prefill's
        # static input and outputs, made on first use (`_prefill_buffers`).
        self.prefill_keep = torch.zeros((), dtype=torch.long, device=dev)
        self.prefill_ids: torch.Tensor | None = None
        self.prefill_hidden: torch.Tensor | None = None
        self.prefill_features: torch.Tensor | None = None
        self.prefill_steps: dict[int, Step] = {}  # captured prefills by padded width
        self._widths_seen: set[int] = set()  # widths prefilled once, eagerly (`_graph_width`)
        self.prefill_capture_error: str | None = None
        self.prefill_padded_width: int | None = None  # the last prefill's, None where it ran unpadded
        self.prefill_most = min(PREFILL_GRAPH_MAX, self.slots)  # the widest padded prefill
        self._pool = None
        self.num_tokens = 0  # host mirror of `length`
        cuda = dev.type == "cuda"
        # The commit's own stream on a GPU (see the module docstring); None: commits run in line.
        self.commit_stream = torch.cuda.Stream(dev) if cuda and self.overlap_commit else None
        self._commit_in_flight = False
        # Pinned host memory and an event for reading a round's result while the GPU goes on (session.py).
        self.host_values = torch.zeros(block_size + 1, dtype=torch.long, pin_memory=True) if cuda else None
        self.read_event = torch.cuda.Event() if cuda else None
        self.steps = {
            "decode": Step(self._decode, "decode"),
            "verify": Step(self._verify, "verify"),
            "commit": Step(self._commit, "commit"),
        }

    # ---- public steps ----------------------------------------------------------------------------------------

    def capture(self) -> None:
        """Record decode, verify and commit as CUDA graphs (CUDA only). Call before `prefill`: warm-up runs
        write into the caches."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA target, this one is on {self.device}")
        self.join()
        with torch.inference_mode():
            capture_all(list(self.steps.values()))
            self.length.zero_()
            self.keep.fill_(1)
        self.num_tokens = 0

    @property
    def captured(self) -> bool:
        return all(step.graph is not None for step in self.steps.values())

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
        """Fill the caches with the prompt `ids` (1-D, from an empty cache); returns the last token's logits (V,).

        Features of the prompt tokens are left in `prompt_features` (P, n * D) when feature layers were given,
        their final-normed hidden states in `prompt_hidden` (both valid until the next prefill). pad_to: run the
        prefill padded to this width (what a captured prefill replays; default: so where a captured engine has
        a graph of the width, `_graph_width`).
        """
        length = ids.shape[0]
        if not 0 < length <= self.max_len:
            raise ValueError(f"prompt of {length} tokens: the engine holds 1 .. max_len={self.max_len} tokens")
        self.join()
        width = self._graph_width(length) if pad_to is None else pad_to
        if width is not None and not length <= width <= self.prefill_most:
            raise ValueError(f"pad_to={width}: a prompt of {length} tokens pads to {length} .. {self.prefill_most}")
        self.prefill_keep.fill_(length)
        self.prefill_padded_width = width
        if width is None:
            hidden, features = self._prefill_body(ids.to(self.device))
            self.prompt_features = torch.cat(features, dim=-1) if features else None
        else:
            self._prefill_buffers()
            self.prefill_ids[:length].copy_(ids)
            self.prefill_ids[length:width].zero_()
            self._prefill_step(width)()
            hidden = self.prefill_hidden[:length]
            self.prompt_features = self.prefill_features[:length] if self.feature_layers else None
        self.prompt_hidden = hidden
        self.num_tokens = length
        return self.lm_head(hidden[-1:])[0]

    def prefill_width(self, length: int) -> int | None:
        """The padded width a captured prefill of `length` tokens runs at, or None (eagerly)."""
        width = -(-length // PREFILL_QUANTUM) * PREFILL_QUANTUM
        return width if width <= self.prefill_most and self.prefill_capture_error is None else None

    def _graph_width(self, length: int) -> int | None:
        """The width a prefill of `length` tokens replays a graph at, or None (eagerly). A width is captured the second
        time a prompt needs it (or ahead, by `capture_prefill`): a capture costs several eager prefills, which a
        one-off prompt length would not win back."""
        width = self.prefill_width(length) if self.captured else None
        if width is None or width in self.prefill_steps or width in self._widths_seen:
            return width
        self._widths_seen.add(width)
        return None

    def capture_prefill(self, lengths) -> None:
        """Capture the prefill graphs that prompts of these `lengths` will replay (ahead of timed runs; the caches
        are overwritten). Needs a captured engine."""
        if not self.captured:
            raise RuntimeError("capture the engine first (capture_prefill records prefills for its graphs)")
        for width in self.prefill_widths(lengths):
            self._prefill_step(width)

    def prefill_widths(self, lengths) -> list[int]:
        """The padded widths of prompts of these `lengths` (those prefilled by a graph), in order."""
        widths = {self.prefill_width(length) for length in lengths if 0 < length <= self.max_len}
        return sorted(w for w in widths if w is not None)

    def _prefill_buffers(self) -> None:
        if self.prefill_ids is not None:
            return
        rows, dev, dt = self.prefill_most, self.device, self.dtype
        self.prefill_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.prefill_hidden = torch.zeros(rows, self.inner.config.hidden_size, dtype=dt, device=dev)
        self.prefill_features = torch.zeros(rows, self.features.shape[1], dtype=dt, device=dev)

    def _prefill_step(self, width: int) -> Step:
        """The prefill padded to `width`: captured on a GPU once the engine is (after a capture that fails, every
        later prefill runs unpadded)."""
        self._prefill_buffers()
        step = self.prefill_steps.get(width)
        if step is None:
            step = self.prefill_steps[width] = Step(lambda: self._padded_prefill(width), f"prefill {width}")
            if self.captured and self.prefill_capture_error is None:  # one failed capture is enough
                self.prefill_capture_error = capture_or_warn(step, self.prefill_pool())
        return step

    def prefill_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # the prefill graphs run one at a time: one pool
        return self._pool

    @torch.inference_mode()
    def decode(self) -> None:
        """One token (`decode_ids`) at position `length`; its logits into `decode_logits`; length += 1."""
        self._check_room(1)
        self.join()
        self.steps["decode"]()
        self.num_tokens += 1

    @torch.inference_mode()
    def verify(self) -> None:
        """The block `verify_ids` at positions `length` ..; logits into `verify_logits`, features into `features`.

        The caches advance only at `commit`.
        """
        self._check_room(self.block_size)
        self.join()
        self.steps["verify"]()

    @torch.inference_mode()
    def commit(self) -> None:
        """Keep the first `keep` (a device tensor, 1 .. block_size) tokens of the last verified block.

        The caller writes `keep` on the device (no host round trip) and reports the number with
        `note_committed` once it has read it. On a GPU it runs on `commit_stream` (see `join`).
        """
        if self.commit_stream is None:
            self.steps["commit"]()
            return
        self.commit_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.commit_stream):
            self.steps["commit"]()
        self._commit_in_flight = True

    def join(self) -> None:
        """Make the current stream wait for a commit in flight (no host synchronisation). The engine's own steps
        call it; call it before reading the caches or `length` directly."""
        if self._commit_in_flight:
            torch.cuda.current_stream(self.device).wait_stream(self.commit_stream)
            self._commit_in_flight = False

    def note_committed(self, keep: int) -> None:
        if not 1 <= keep <= self.block_size:
            raise ValueError(f"keep must be in [1, {self.block_size}], got {keep}")
        self.num_tokens += keep

    def _check_room(self, tokens: int) -> None:
        if self.num_tokens + tokens > self.slots:
            raise RuntimeError(f"engine cache full: {self.num_tokens} + {tokens} tokens > {self.slots} slots")

    # ---- step bodies (captured; only static buffers in and out) ----------------------------------------------

    def _prefill_body(self, ids: torch.Tensor):
        """The prompt `ids` (true length in `prefill_keep`, any padding after it) from empty states."""
        if self.linear is not None:
            self.linear.conv.zero_()
            self.linear.recurrent.zero_()
        hidden, features = self._forward(ids, self.slot_index[: ids.shape[0]], mode="prefill")
        self.length.copy_(self.prefill_keep)
        return hidden, features

    def _padded_prefill(self, width: int) -> None:
        hidden, features = self._prefill_body(self.prefill_ids[:width])
        self.prefill_hidden[:width].copy_(hidden)
        if features:
            self.prefill_features[:width].copy_(torch.cat(features, dim=-1))

    def _decode(self) -> None:
        positions = self.length + self.block_index[:1]
        hidden, _ = self._forward(self.decode_ids, positions, mode="decode")
        self.decode_logits.copy_(self.lm_head(hidden))
        self.length.add_(1)

    def _verify(self) -> None:
        positions = self.length + self.block_index
        hidden, features = self._forward(self.verify_ids, positions, mode="verify")
        self.verify_hidden.copy_(hidden)
        self.verify_logits.copy_(self.lm_head(hidden))
        if features:
            self.features.copy_(torch.cat(features, dim=-1))

    def _commit(self) -> None:
        self.length.add_(self.keep)
        if self.linear is not None:
            commit_linear(self.linear, self.keep, self.block_index)

    # ---- the model -------------------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mode: str):
        """Final-normed hidden states (T, D) of tokens `ids` at `positions`, and the feature layers' outputs."""
        hidden = self.inner.embed_tokens(ids)[None]
        cos, sin = self.cos[positions], self.sin[positions]
        visible = None if mode == "prefill" else self.slot_index[None] <= positions[:, None]
        features = []
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = self._norm(layer.input_layernorm, hidden)[0]
            if self.linear is not None and i in self.linear.slot:
                gated_norm = self.gated_norms[i]
                x = linear_attention(layer.linear_attn, self.linear, i, x, mode, gated_norm, self.prefill_keep)
            else:
                x = attention(layer.self_attn, x, positions, cos, sin, self.kv[i], visible, self._norm)
            hidden = residual + x[None]
            hidden = hidden + layer.mlp(self._norm(layer.post_attention_layernorm, hidden))
            if i in self.feature_layers:
                features.append(hidden[0])
        return self._norm(self.inner.norm, hidden)[0], features

    def _norm(self, module, x):
        return self.norms[id(module)](x)
