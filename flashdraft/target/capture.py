"""The frozen target: load it, keep only the layers the drafter reads, and capture their hidden states.

    target = load_frozen_target(TargetConfig(path="Qwen/Qwen3.5-27B"))  # flashdraft.target.load; bf16 on the GPU
    features = target.capture(input_ids, attention_mask)   # (B, T, n * D), layer i = hidden_states[i + 1]
    block = target.embed(block_ids)                        # the target's frozen input embedding
    drafter = DFlashDraftModel.from_target(target.config, target_layer_ids=target.target_layer_ids)

Training needs the target only up to its last captured layer (`flops.step_flops` counts no more): the decoder layer list is
truncated after `max(target_layer_ids)` (at load time, so the dropped layers are never read from disk), the final
norm is replaced by an identity and the LM head is never called — only its weight is kept, for the drafter's loss.
Features are captured by forward hooks on the decoder layers, written straight into one preallocated buffer.
`target.precision: fp8` runs the kept layers' linears as FP8 GEMMs (flashdraft/fastpath/fp8.py), proven by the probe.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from flashdraft import fastpath
from flashdraft.config import ConfigError, resolve_switch
from flashdraft.drafter.config import target_text_config
from flashdraft.fastpath import fp8
from flashdraft.fastpath.probe import FastPathReport

logger = logging.getLogger(__name__)


def glue_compile_enabled(options, device: torch.device) -> bool:
    """`target.compile` resolved for `device` (`options`: the config's target section). auto compiles on CUDA, where
    it bought 7% of a 27B step at 32K tokens on the H200 (bench/RESULTS.md), but not a sharded target
    (`target.shard`: FSDP2's gathered layers have not been tried compiled) nor on the CPU (a C++ toolchain, and
    tiny targets gain nothing)."""
    return resolve_switch("target.compile", options.compile, device.type == "cuda" and not options.shard)


class FrozenTarget:
    """A frozen causal LM truncated after its last captured layer; see the module docstring.

    Attributes:
        model: the (truncated) transformers causal LM, eval mode, no parameter requires grad.
        config: the *full* text config of the target (all layers), what a drafter is built from.
        target_layer_ids: the layers whose outputs `capture` concatenates, in this order.
        fastpath_report: what `fastpath.enable` proved for each linear-attention layer (empty for plain targets).
        cudnn_attention: `capture` on a GPU tries SDPA's cuDNN backend first (`target.cudnn_attention`).
        glue_compiled: whether the torch code between the fast kernels runs compiled (`compile_glue`).
        precision: "bf16", or "fp8" once `set_precision` has converted the kept layers' linears.
    """

    cudnn_attention: bool = False
    precision: str = "bf16"

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        config=None,
        strict: bool | None = None,
        final_hidden: bool = False,
    ) -> None:
        text_config = target_text_config(model.config)
        self.config = copy.deepcopy(config if config is not None else text_config)
        self.num_target_layers = int(self.config.num_hidden_layers)
        self.target_layer_ids = _validate_layer_ids(target_layer_ids, self.num_target_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.name_or_path: str | None = getattr(self.config, "_name_or_path", None) or None

        self.model = model.eval().requires_grad_(False)
        self.decoder = model.get_decoder()
        # `final_hidden` (recipe.labels: target) keeps every layer: the final-normed last hidden state, through the
        # LM head, is the target's next-token distribution the drafter learns.
        self.final_hidden = final_hidden
        last = self.num_target_layers - 1 if final_hidden else max(self.target_layer_ids)
        _truncate(self.decoder, text_config, last + 1)
        # hidden_states[L] of transformers is the final-normed output: to honour "layer i = hidden_states[i + 1]"
        # for the last layer too, its capture goes through the norm; the decoder itself never runs it.
        self._final_norm = self.decoder.norm if last == self.num_target_layers - 1 else None
        self.decoder.norm = nn.Identity()
        self._lm_head_weight = model.get_output_embeddings().weight

        param = next(model.parameters())
        if strict is None:
            strict = param.device.type == "cuda"
        self.strict = strict
        self.precision = "fp8" if fp8.fp8_linears(self.decoder) else "bf16"
        started = time.perf_counter()
        self.fastpath_report: FastPathReport = fastpath.enable(model, strict=strict)
        # On a freshly started GPU machine: the fast kernels' first JIT compilation and autotuning.
        self.probe_seconds = time.perf_counter() - started
        if self.fastpath_report.layers:
            # On a CPU the torch fallback is expected (and correct); on a GPU a fallback costs ~2x target time.
            slow = not self.fastpath_report.ok and param.device.type != "cpu"
            (logger.warning if slow else logger.info)("target fast path: %s", self.fastpath_report.summary())
        logger.info(
            "target: %d of %d layers kept (captured %s), %s on %s",
            last + 1,
            self.num_target_layers,
            self.target_layer_ids,
            str(param.dtype).replace("torch.", ""),
            param.device,
        )

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        strict: bool | None = None,
        final_hidden: bool = False,
    ) -> FrozenTarget:
        """Wrap an in-memory causal LM. It is modified in place (frozen, truncated, final norm removed).

        `strict` (default: True on CUDA) makes a linear-attention layer that fell back to torch an error.
        `final_hidden` keeps every layer so that `capture(..., final=True)` can return the final hidden states.
        """
        return cls(model, target_layer_ids, strict=strict, final_hidden=final_hidden)

    # ---- what the trainer reads ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._lm_head_weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, D): the target's LM head (tied to the embedding on small Qwen3.5s); never run here, only read."""
        return self._lm_head_weight

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids → (B, L, D) with the target's frozen input embedding."""
        return self.model.get_input_embeddings()(ids)

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, final: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of `target_layer_ids` → (B, T, n * D), concatenated in that order; with `final` (a target
        built with `final_hidden`) also the final-normed last hidden states (B, T, D), `output_hidden_states[-1]`,
        whose product with the LM head is the model's logits.

        Layer i's slice equals `output_hidden_states[i + 1]` of the full model at every token. `attention_mask`
        (B, T), 1 = token, marks right padding; the features at padding positions are left undefined. Under no_grad
        (not inference_mode: the features are saved for the drafter's backward).

        The decoder runs without the mask: its layers are causal, so a token never reads the padding after it, and
        a padding mask would make transformers build a dense (B, 1, T, T) attention mask (17 GB at 131072 tokens)
        and leave the flash kernels for masked ones.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        if final and not self.final_hidden:
            raise ValueError("capture(final=True) needs a target built with final_hidden=True (its last layers kept)")
        _check_right_padding(attention_mask, input_ids.shape)
        batch, length = input_ids.shape
        width = self.hidden_size
        # One buffer, each layer's output copied once into its slice as soon as it exists: holding n layer outputs
        # and concatenating at the end would keep n * B * T * D extra elements alive until the cat.
        features = torch.empty(
            batch, length, len(self.target_layer_ids) * width, dtype=self.dtype, device=input_ids.device
        )
        slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.target_layer_ids):
            slots.setdefault(layer, []).append(slot)
        last = self.num_target_layers - 1
        final_states = None
        if final:
            final_states = torch.empty(batch, length, width, dtype=self.dtype, device=input_ids.device)
            slots.setdefault(last, [])
        written: set[int] = set()

        def write(layer: int, _module, _args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            if self._final_norm is not None and layer == last:
                hidden = self._final_norm(hidden)
                if final_states is not None:
                    final_states.copy_(hidden)
            for slot in slots[layer]:
                features[..., slot * width : (slot + 1) * width].copy_(hidden)
            written.add(layer)

        layers = self.decoder.layers
        handles = [layers[i].register_forward_hook(_bind(write, i)) for i in slots]
        try:
            with self._sdpa_priority():
                self.decoder(input_ids=input_ids, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        if written != set(slots):
            raise RuntimeError(f"target layers {sorted(set(slots) - written)} did not run during capture")
        return features if final_states is None else (features, final_states)

    def configure(self, options) -> None:
        """Apply the `target.*` switches that change how the target runs (`options`: the config's target section):
        its precision, cuDNN attention first, compiled glue. The last two are set or unset, so one target can serve
        several configurations in turn (the benchmarks' variants); bf16 -> fp8 is one-way (see `set_precision`)."""
        self.set_precision(options.precision)
        self.cudnn_attention = options.cudnn_attention
        self.compile_glue(glue_compile_enabled(options, self.device))

    def set_precision(self, precision: str) -> None:
        """`target.precision`: "fp8" converts the kept layers' linears to FP8 GEMMs in place (fastpath/fp8.py) and
        probes the target again, so that the FP8 linears are proven beside the linear-attention kernels (strict:
        a FastPathError when one is not). One-way: the bf16 weights are freed as they are converted."""
        if precision == self.precision:
            return
        if precision != "fp8":
            raise ValueError(
                f"target.precision = {precision}: this target's linears are {self.precision} already (converted in "
                "place; load the target again for bf16)"
                if precision == "bf16"
                else f"target.precision = {precision!r}: must be bf16 or fp8"
            )
        check_fp8(self.device, self.dtype)
        converted = fp8.convert_linears(self.decoder.layers)
        self.precision = "fp8"
        started = time.perf_counter()
        self.fastpath_report = fastpath.probe(self.model)
        self.probe_seconds += time.perf_counter() - started
        if self.strict and not self.fastpath_report.ok:
            raise fastpath.FastPathError(self.fastpath_report)
        logger.info("target: %d linears in FP8; %s", len(converted), self.fastpath_report.summary())

    @property
    def glue_compiled(self) -> bool:
        return any(_is_compiled(m) for m in self._glue_modules())

    def compile_glue(self, enabled: bool = True) -> int:
        """torch.compile, in place, the torch code between the target's fast kernels (`target.compile`): every plain
        RMSNorm of the kept layers (eager, Qwen3.5's upcasts to float32 and makes ~8 passes over its input; compiled,
        one) and every dense MLP (SiLU and the product fused). The matmuls, attention, fla's and flashdraft's
        kernels stay as they are; parameter names do not change. `enabled=False` puts the eager forwards back.
        Idempotent; returns how many modules are compiled now. Lengths vary between batches: the first length
        compiles a static graph, the second a dynamic one that serves every later length.
        """
        modules = self._glue_modules()
        for module in modules:
            if enabled and not _is_compiled(module):
                # An instance attribute over whatever forward the module has (the class's, or a patch of someone
                # else's, kept on the wrapper to be put back): no private state of nn.Module is touched.
                compiled = torch.compile(module.forward)
                compiled.flashdraft_eager_forward = vars(module).get("forward")
                module.forward = compiled
            elif not enabled and _is_compiled(module):
                previous = module.forward.flashdraft_eager_forward
                del module.forward
                if previous is not None:
                    module.forward = previous
        return len(modules) if enabled else 0

    def _glue_modules(self) -> list[nn.Module]:
        """Plain RMSNorms, dense MLPs, and the FP8 linears outside them (their per-row quantization is elementwise
        work that compiles into one pass; inside a compiled MLP it is compiled with it)."""
        found = []
        for layer in self.decoder.layers:
            dense = [name for name, module in layer.named_modules() if _is_dense_mlp(name, module)]
            for name, module in layer.named_modules():
                plain_norm = type(module).__name__.endswith("RMSNorm") and not list(module.children())
                lone_fp8 = isinstance(module, fp8.FP8Linear) and not any(name.startswith(f"{d}.") for d in dense)
                if plain_norm or name in dense or lone_fp8:
                    found.append(module)
        return found

    def _sdpa_priority(self):
        if not (self.cudnn_attention and self.device.type == "cuda"):
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        return sdpa_kernel(order, set_priority=True)


def check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    """A ConfigError naming `target.precision` when a target on `device` in `dtype` cannot run FP8 linears."""
    reason = fp8.unsupported_reason(device)
    if reason is not None:
        raise ConfigError(f"target.precision = fp8: {reason}; use target.precision=bf16", field="target.precision")
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"target.precision = fp8 needs a bfloat16 target (the FP8 GEMM writes bf16), this one is "
            f"{str(dtype).replace('torch.', '')}: set target.dtype=bfloat16 (or auto)",
            field="target.precision",
        )


def _check_right_padding(mask: torch.Tensor | None, shape: torch.Size) -> None:
    """`capture` runs the decoder without its mask, which is exact only for right padding: check that it is."""
    if mask is None:
        return
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(shape)}, got {tuple(mask.shape)}")
    padded_inside = (mask[:, 1:] > mask[:, :-1]).any()
    message = "attention_mask: only right padding is supported (a 1 after a 0 in a row)"
    if mask.device.type == "cpu":
        if bool(padded_inside):
            raise ValueError(message)
    else:
        # Checked on the device: a host sync here would stall the GPU between a step's micro-batches.
        torch._assert_async(~padded_inside, message)


def _is_dense_mlp(name: str, module: nn.Module) -> bool:
    return name == "mlp" and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))


def _is_compiled(module: nn.Module) -> bool:
    return hasattr(vars(module).get("forward"), "flashdraft_eager_forward")


def _bind(fn, layer: int):
    return lambda module, args, output: fn(layer, module, args, output)


def _validate_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    ids = list(ids)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"target_layer_ids must be a non-empty list of integers, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are out of range: the target has layers 0..{num_layers - 1}")
    return ids


def _truncate(decoder: nn.Module, text_config, keep: int) -> None:
    """Keep decoder layers [0, keep); the config follows, so caches and mask builders agree with the modules."""
    if len(decoder.layers) > keep:
        decoder.layers = nn.ModuleList(list(decoder.layers)[:keep])
    _truncate_config(text_config, keep)


def _truncate_config(text_config, keep: int) -> None:
    text_config.num_hidden_layers = keep
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        text_config.layer_types = list(layer_types)[:keep]
