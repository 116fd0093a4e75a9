"""Data-parallel training over the ranks of a torchrun job (job.py): each rank's share of a step, sums over
ranks, and the drafter and target sharded with FSDP2. In one process every function here is the identity.

- Global batch: one optimizer step takes `train.batch_size x train.grad_accum x world` sequences. The data loader
  (flashdraft.train.dataloader) cuts the step's samples (a pure function of (seed, step)) into `grad_accum x world`
  micro-batches; rank r takes the r-th `grad_accum` of them (`rank_share`). So 1 process with grad_accum=2 and 2
  processes with grad_accum=1 train on the same micro-batches, and the loss is normalised over the whole global
  step (`all_sum` of the weights): the same losses up to the order of the sums.
- Every rank holds the frozen target (replicated; `target.shard=true` shards its decoder layers with FSDP2) and
  the drafter under FSDP2 (`parallelize_drafter` says why not DDP).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import fields

import torch
import torch.distributed as dist

from flashdraft.distributed.ranks import world

logger = logging.getLogger(__name__)


def rank_share(micro_batches: list) -> list:
    """This rank's micro-batches of a global step: the r-th of `world` equal contiguous parts."""
    here = world()
    if len(micro_batches) % here.size:
        raise ValueError(f"{len(micro_batches)} micro-batches do not split over {here.size} ranks")
    per_rank = len(micro_batches) // here.size
    return micro_batches[here.rank * per_rank : (here.rank + 1) * per_rank]


def all_sum(value: torch.Tensor) -> torch.Tensor:
    """Σ over ranks of a tensor (a new tensor; `value` itself when there is one process)."""
    if world().size == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out)
    return out


def sum_stats(stats, tokens: int):
    """(LossStats, tokens) summed over ranks in one all_reduce: the logged step is the global step.

    Packed as float64, which holds the integer counts exactly and the sum of two float32s exactly.
    """
    if world().size == 1:
        return stats, tokens
    names = [f.name for f in fields(stats)]
    parts = [getattr(stats, n) for n in names]
    flat = torch.cat([p.reshape(-1).double() for p in parts] + [torch.tensor([float(tokens)], device=parts[0].device)])
    dist.all_reduce(flat)
    out, at = {}, 0
    for name, part in zip(names, parts, strict=True):
        out[name] = flat[at : at + part.numel()].view(part.shape).to(part.dtype)
        at += part.numel()
    return type(stats)(**out), int(flat[at].item())


def parallelize_drafter(drafter: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard the drafter with FSDP2 (`fully_shard` per decoder layer, then the root); identity in one process.

    FSDP2 rather than DDP: (1) it shards the float32 master weights, gradients and AdamW moments (16 bytes per
    parameter: ~27 GB for a drafter of a 27B target's width, replicated on every GPU under DDP) — memory the
    target's activations need; (2) the module stays itself (no `.module` wrapper), so the loop, the recipe and
    `save_pretrained` see the same object with one process or many; (3) its sharded state is what
    torch.distributed.checkpoint writes in parallel and re-shards on load, so a checkpoint of N ranks resumes on M.
    The cost is an all-gather of each layer's weights per micro-batch, small next to the target's forward.

    Gradients are summed, not averaged, over ranks: each rank's loss is already divided by the global step's
    weight (`all_sum`), so the sum is the gradient of the one-process loss.
    """
    if world().size == 1:
        return drafter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world().size,))
    # The unsharded weights of one layer stay until its backward: the drafter is small next to the target, and
    # this saves an all-gather per layer and micro-batch.
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(drafter, mesh=mesh, reshard_after_forward=False)
    for module in [*drafter.layers, drafter]:  # per fully_shard unit: the setters do not recurse
        module.set_gradient_divide_factor(1.0)
        # A plain SUM (gloo has no PREMUL_SUM, and NCCL's SUM is its zero-copy path); the division by 1 is a no-op.
        module.set_force_sum_reduction_for_comms(True)
    return drafter


def shard_target(model: torch.nn.Module, device: torch.device) -> None:
    """`target.shard`: FSDP2-shard the frozen target's decoder layers over the ranks, in place, onto `device`.

    The model may sit in CPU memory (it is loaded there when it does not fit one GPU): each rank keeps 1/N of every
    layer's weights on `device` and all-gathers one layer at a time during the forward; the embedding, norms and LM
    head go to `device` whole (the drafter's loss and block embedding read them directly). Every rank runs the same
    number of target forwards per step (equal micro-batches), so the all-gathers line up.
    """
    if world().size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder()
    layers = decoder.layers
    decoder.layers = torch.nn.ModuleList()
    model.to(device)  # everything but the layers
    decoder.layers = layers
    mesh = init_device_mesh(device.type, (world().size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)  # moves its shard to the mesh's device
    params = [p for layer in layers for p in layer.parameters()]
    local = sum(p.to_local().numel() * p.element_size() for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    logger.info(
        "target: %d decoder layers sharded over %d ranks: %.1f of %.1f MiB of their weights per rank",
        len(layers),
        world().size,
        local / 2**20,
        full / 2**20,
    )


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, returning a plain tensor also when the gradients are sharded DTensors."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def gather_drafter(drafter: torch.nn.Module, device: torch.device | None = None):
    """The drafter as a plain module on rank 0 (None on the others): for decoding, which only rank 0 does.

    Collective: every rank must call it. In one process, `drafter` itself.
    """
    if world().size == 1:
        return drafter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not world().is_main:
        return None
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 swapped the module's class for a subclass of (FSDPModule, original class): build the original.
    cls = next(c for c in type(drafter).__mro__ if not issubclass(c, FSDPModule))
    plain = cls(drafter.config)
    plain.load_state_dict(full)
    return plain.to(device if device is not None else next(drafter.parameters()).device)
