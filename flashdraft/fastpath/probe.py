"""Per-layer proof of which implementation each Gated DeltaNet call really used, and of the FP8 linears.

The probe runs a short prefill and one cached decode step through the model and records, for every
linear-attention layer, the implementation behind each of its four calls — whatever put it there
(flashdraft's patch, transformers' import-time choice, or nothing). Every FP8 linear of the model
(`target.precision: fp8`, fastpath/fp8.py) is checked in the same run: it must have been called, and its output
must equal the float32 product of its quantized input and weight up to the output's rounding.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import torch

from flashdraft.fastpath import fp8, record
from flashdraft.fastpath.backends import DAO_CUDA, FLA, FLASHDRAFT_TRITON, GATED_NORM, OPS, TORCH, hub_wrapped
from flashdraft.fastpath.patch import GLOBALS, INSTANCE, entry_points, generation_of, linear_attention_layers
from flashdraft.versions import cache_kwargs, returned_cache

NOT_CALLED = "not called"
# Column headers of the per-layer table (the JSON keeps the full call names).
SHORT_NAMES = dict(zip(OPS, ("conv", "conv update", "chunk rule", "recurrent rule", "gated norm"), strict=True))


@dataclass
class OpUse:
    impl: str
    reason: str = ""

    @property
    def fast(self) -> bool:
        return self.impl not in (TORCH, NOT_CALLED) and not self.impl.startswith("error")


@dataclass
class LayerUse:
    index: int
    ops: dict[str, OpUse]

    @property
    def fast(self) -> bool:
        return all(use.fast for use in self.ops.values())


@dataclass
class FastPathReport:
    transformers_version: str
    generation: str | None
    device: str
    dtype: str
    attention: str
    layers: list[LayerUse] = field(default_factory=list)
    error: str = ""
    fp8: fp8.FP8Use | None = None
    """The FP8 linears, when the model has any (`target.precision: fp8`)."""

    @property
    def ok(self) -> bool:
        fp8_ok = self.fp8 is None or self.fp8.ok
        return not self.error and all(layer.fast for layer in self.layers) and fp8_ok

    def fallbacks(self) -> dict[str, list[int]]:
        """reason -> layers whose calls fell back for it."""
        out: dict[str, list[int]] = {}
        for layer in self.layers:
            for op, use in layer.ops.items():
                if not use.fast:
                    key = f"{op}: {use.impl}" + (f" ({use.reason})" if use.reason else "")
                    out.setdefault(key, [])
                    if layer.index not in out[key]:
                        out[key].append(layer.index)
        return out

    def failure_message(self) -> str:
        lines = [f"fast path incomplete on {len(self.slow_layers())} of {len(self.layers)} linear-attention layers"]
        if self.error:
            lines.append(f"probe error: {self.error}")
        for reason, layers in self.fallbacks().items():
            lines.append(f"  {'layers' if len(layers) > 1 else 'layer'} {_ranges(layers)}: {reason}")
        if self.fp8 is not None and not self.fp8.ok:
            lines.append(f"  {self.fp8.summary()}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: how many layers fell back and the distinct reasons (and the FP8 linears, if any)."""
        fp8_text = f"; {self.fp8.summary()}" if self.fp8 is not None else ""
        if self.ok:
            if not self.layers and self.fp8 is not None:
                return self.fp8.summary()
            return f"all {len(self.layers)} linear-attention layers ran fast kernels" + fp8_text
        reasons = sorted(
            {use.reason or use.impl for layer in self.layers for use in layer.ops.values() if not use.fast}
        )
        text = f"{len(self.slow_layers())} of {len(self.layers)} linear-attention layers fell back: " + "; ".join(
            reasons
        )
        text += fp8_text
        return f"probe error: {self.error}; " + text if self.error else text

    def slow_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if not layer.fast]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        if self.fp8 is not None:
            d["fp8"]["ok"] = self.fp8.ok
        d["layers"] = [
            {
                "index": layer.index,
                "fast": layer.fast,
                "ops": {op: asdict(use) | {"fast": use.fast} for op, use in layer.ops.items()},
            }
            for layer in self.layers
        ]
        return d

    def table(self):
        from rich.table import Table

        table = Table(
            title=f"fast path per layer — {self.device}, {self.dtype}, transformers {self.transformers_version}"
        )
        table.add_column("layer", justify="right")
        for op in OPS:
            table.add_column(SHORT_NAMES[op])
        for layer in self.layers:
            cells = [f"[green]{u.impl}[/]" if u.fast else f"[red]{u.impl}[/]" for u in layer.ops.values()]
            table.add_row(str(layer.index), *cells)
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=140, record=True, file=_NullIO(), force_terminal=False)
        console.print(self.table())
        summary = "all fast" if self.ok else self.failure_message()
        if self.fp8 is not None:
            summary += f"\n{self.fp8.summary()}"
        return console.export_text() + f"attention: {self.attention}; lookup: {self.generation}\n{summary}\n"


class _NullIO:
    def write(self, _):
        return 0

    def flush(self):
        pass


def _ranges(indices: list[int]) -> str:
    indices = sorted(indices)
    parts, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def _closure(fn) -> dict[str, object]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True)) if code is not None else {}


def describe(fn, device_type: str | None = None) -> tuple[str, str]:
    """Classify a callable that flashdraft did not install: (implementation, reason).

    device_type: where the call's inputs are (transformers 5.25+ sends inputs on a device the chosen package does
    not support to the torch reference itself).
    """
    if fn is None:
        return TORCH, "no causal-conv1d at import: the layer runs nn.Conv1d"
    # transformers 5.15+ wraps the chosen implementation in a closure cell called `implementation` (inside the
    # `kernels` package's module wrapper when a release of it that transformers accepts is installed).
    cells = _closure(hub_wrapped(fn))
    fn = cells.get("implementation", fn)
    supported = cells.get("supported_devices")
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("fla"):
        impl = FLA
    elif module.startswith("causal_conv1d"):
        impl = DAO_CUDA
    elif module.startswith("flashdraft"):
        return FLASHDRAFT_TRITON, ""
    else:
        return TORCH, "fallback: chosen by transformers at import (fast package missing or failed to import)"
    if supported is not None and device_type is not None and device_type not in supported:
        return (
            TORCH,
            f"fallback: transformers' own device check ({impl} runs on {', '.join(supported)}, not {device_type})",
        )
    return impl, "chosen by transformers at import"


def _tracer(op: str, fn):
    @functools.wraps(hub_wrapped(fn))
    def traced(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        record.note(op, *describe(fn, None if tensor is None else tensor.device.type))
        return fn(*args, **kwargs)

    return traced


def _noting(op: str, impl: str, reason: str, fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        record.note(op, impl, reason)
        return fn(*args, **kwargs)

    return traced


def probe(model: torch.nn.Module, num_tokens: int = 8) -> FastPathReport:
    """Run a short prefill and one cached decode step; return which implementation each call used, per layer."""
    import transformers

    param = next(model.parameters())
    config = getattr(model, "config", None)
    report = FastPathReport(
        transformers_version=transformers.__version__,
        generation=None,
        device=str(param.device),
        dtype=str(param.dtype).replace("torch.", ""),
        attention=str(getattr(config, "_attn_implementation", "?")),
    )
    layers = linear_attention_layers(model)
    linears = fp8.fp8_linears(model)
    if not layers and not linears:
        return report
    report.generation = generation_of(layers[0][1]) if layers else None
    fp8_errors: dict[str, float] = {}

    restore: list[tuple[object, str, object]] = []
    static: dict[int, dict[str, OpUse]] = {}
    for idx, layer in layers:
        for op, (owner, name) in entry_points(layer).items():
            fn = getattr(owner, name, None)
            if getattr(fn, "__flashdraft_backend__", False):
                continue  # our backends note their own per-call choice
            if fn is None:  # 5.2-5.14 without causal-conv1d: the layer calls nn.Conv1d directly
                static.setdefault(idx, {})[op] = OpUse(*describe(None))
                continue
            if any(o is owner and n == name for o, n, _ in restore):
                continue  # a module global shared by many layers: wrap it once
            restore.append((owner, name, fn))
            setattr(owner, name, _tracer(op, fn))
        norm_forward = layer.norm.forward
        if not getattr(norm_forward, "__flashdraft_backend__", False):
            impl = FLA if type(layer.norm).__module__.startswith("fla") else TORCH
            reason = "" if impl == FLA else "fallback: transformers' torch RMSNormGated (no fused kernel)"
            restore.append((layer.norm, "forward", None))
            layer.norm.forward = _noting(GATED_NORM, impl, reason, norm_forward)

    with record.listening() as log:
        hooks = []
        for idx, layer in layers:
            hooks.append(layer.register_forward_pre_hook(functools.partial(_enter, log, idx)))
            hooks.append(layer.register_forward_hook(functools.partial(_leave, log)))
        for name, linear in linears:
            hooks.append(linear.register_forward_hook(functools.partial(fp8.check_output, fp8_errors, name)))
        try:
            # Eager, even where the target's glue is compiled: the hooks read values on the host.
            with torch.compiler.set_stance("force_eager"):
                _run(model, param.device, num_tokens)
        except Exception as exc:  # report, do not hide: a fast kernel that crashes is not a fast path
            report.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if log.last is not None:  # blame the call that was running
                layer, op, impl = log.last
                log.calls[layer][op][-1] = (f"error in {impl}", report.error)
        finally:
            for h in hooks:
                h.remove()
            for owner, name, fn in restore:
                if fn is None:  # we shadowed a method with an instance attribute: remove it
                    owner.__dict__.pop(name, None)
                else:
                    setattr(owner, name, fn)

    if linears:
        report.fp8 = fp8.FP8Use.from_errors(linears, fp8_errors)
    for idx, _ in layers:
        seen = log.calls.get(idx, {})
        ops = {}
        for op in OPS:
            if op in static.get(idx, {}):
                ops[op] = static[idx][op]
            elif op in seen:
                impls = {impl for impl, _ in seen[op]}
                impl, reason = seen[op][-1] if len(impls) == 1 else ("mixed: " + "+".join(sorted(impls)), "")
                ops[op] = OpUse(impl, reason)
            else:
                ops[op] = OpUse(NOT_CALLED, "the probe did not reach this call")
        report.layers.append(LayerUse(idx, ops))
    return report


def _enter(log: record.CallLog, idx: int, *_):
    log.layer = idx


def _leave(log: record.CallLog, *_):
    log.layer = None


@torch.no_grad()
def _run(model: torch.nn.Module, device: torch.device, num_tokens: int) -> None:
    config = model.config
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=generator).to(device)
    # Explicit positions: a target truncated before its first full-attention layer has a cache of linear-attention
    # layers only, and transformers cannot ask such a cache for its length.
    # Such a target also needs its (unused) masks given, or transformers builds a causal mask by asking the cache.
    positions = torch.arange(num_tokens + 1, device=device)
    masks = {} if _has_full_attention(model) else {"attention_mask": {"full_attention": None, "linear_attention": None}}
    out = model(
        input_ids=ids, use_cache=True, cache_position=positions[:-1], position_ids=positions[None, :-1], **masks
    )
    nxt = torch.randint(0, vocab, (1, 1), generator=generator).to(device)
    model(
        input_ids=nxt,
        use_cache=True,
        cache_position=positions[-1:],
        position_ids=positions[None, -1:],
        **cache_kwargs(returned_cache(out)),
        **masks,
    )


def _has_full_attention(model: torch.nn.Module) -> bool:
    """Whether any decoder layer the model still holds (it may be truncated) is a full-attention layer."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return True
    kept = next(
        (len(m) for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)),
        len(layer_types),
    )
    return "full_attention" in layer_types[:kept]


__all__ = ["FastPathReport", "LayerUse", "OpUse", "probe", "describe", "GLOBALS", "INSTANCE"]
