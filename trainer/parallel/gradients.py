"""What happens between backward and the optimiser step in every layout: gradient reduction (`reduce_gradients`),
the clipped global gradient norm (`clip_grad_norm_`), the MoE balancing update (`update_router_biases`) and the
job-wide mean or sum of per-rank numbers (`mean_over_data`, `sum_over_data`).

The one place these rules live: the trainer (trainer/train.py) and the layout tests (tests/parallel/) call the
same functions, with a ParallelModel (trainer/parallel/apply.py; meshes None for a single process). Contract:
after `reduce_gradients` every gradient equals the single process's gradient of the job's loss (the mean over
dp x ep x cp of each rank's mean loss); the clip norm and coefficient match the single process's; router biases
stay identical on every rank and equal the single process's.

Design and reasoning: docs/parallelism.md#gradients-clipping-and-balancing
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from model.common import local as local_shard
from trainer.parallel.tensor import reduce_partial_grads
from trainer.parallel.apply import ParallelModel
from trainer.parallel.engram import engram_tables, reduce_engram_gradients
from trainer.parallel.expert import expert_parameters, moe_layers

__all__ = [
    "reduce_gradients", "all_reduce_flat", "clip_grad_norm_", "update_router_biases",
    "reduce_load_counts", "mean_over_data", "sum_over_data", "full_named_tensors",
]


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def reduce_gradients(pm: ParallelModel) -> None:
    """Bring every gradient of this rank's parameters to the single process's value (the rules above)."""
    if pm.meshes is None:
        return

    tables = engram_tables(pm.module) if pm.engram is not None else []
    if tables:
        reduce_engram_gradients(pm.module, pm.meshes.dp_ep_cp.size(), replica_group=pm.engram.replica_group)
    if not pm.fsdp:
        if pm.sequence_parallel:
            reduce_partial_grads(pm.module)
        _reduce_replicated(pm.module, pm.meshes, exclude=tables)
        return
    dims = pm.dims
    if dims.ep * dims.cp == 1:
        return
    experts = {id(p) for p in expert_parameters(pm.module)}
    skip = {id(p) for p in tables}
    params = [p for p in pm.module.parameters() if p.requires_grad and id(p) not in skip]
    missing = [p for p in params if p.grad is None]
    if missing:  # FSDP reduce-scatters unused parameters as zeros (materialize sets that up)
        raise RuntimeError(f"{len(missing)} FSDP parameters have no gradient after backward")
    scale = 1.0 / (dims.ep * dims.cp)
    all_reduce_flat([local_shard(p.grad) for p in params if id(p) not in experts], [pm.ep_cp.get_group()], scale)
    all_reduce_flat([local_shard(p.grad) for p in params if id(p) in experts], [pm.meshes.cp.get_group()], scale)


def all_reduce_flat(grads: list[torch.Tensor], groups: list, scale: float) -> None:
    """grads = scale * (the sum over each group in turn), through one flat buffer."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
    flat *= scale
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def _reduce_replicated(model: nn.Module, meshes, exclude=()) -> None:
    """The path without FSDP (reduce_gradients' part once sequence parallelism's Partial gradients are complete).
    Non-expert weights: mean over dp x ep x cp. Expert weights: sum over their replicas (dp, then cp) divided by
    dp x ep x cp, since the all-to-all backward already summed over the ep peers. `exclude`: parameters reduced
    elsewhere (row-sharded Engram tables: trainer/parallel/engram.py).

    A parameter that got no gradient on some rank (experts no local token chose) is reduced as zeros there,
    the rows the single process's full gradient holds; one that got none on any rank keeps grad None, as in
    the single process.
    """
    skip = {id(p) for p in exclude}
    experts = [p for p in expert_parameters(model) if p.requires_grad]
    expert_ids = {id(p) for p in experts} | skip
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
    data = meshes.dp_ep_cp.get_group()
    used = torch.tensor([p.grad is not None for p in others + experts], dtype=torch.int32)
    if dist.get_world_size(data) > 1:  # every rank holding a part of a parameter votes
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=data)
    live = [p for p, u in zip(others + experts, used.tolist()) if u]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    live_ids = {id(p) for p in live}
    scale = 1.0 / meshes.dp_ep_cp.size()
    all_reduce_flat([local_shard(p.grad) for p in others if id(p) in live_ids], [data], scale)
    all_reduce_flat([local_shard(p.grad) for p in experts if id(p) in live_ids],
                    [meshes.dp.get_group(), meshes.cp.get_group()], scale)


def _shard_groups(g: torch.Tensor) -> tuple:
    """The process groups of the mesh axes that shard this gradient (empty for a plain or replicated tensor)."""
    if not _is_dtensor(g):
        return ()
    groups = []
    for axis, placement in enumerate(g.placements):
        if placement.is_partial():
            raise RuntimeError("clip_grad_norm_: a gradient is still Partial; reduce gradients first")
        # Shard, or FSDP's _StridedShard over an ep-sharded dim (is_shard() is False for it)
        if not placement.is_replicate() and g.device_mesh.size(axis) > 1:
            groups.append(g.device_mesh.get_group(axis))
    return tuple(groups)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pm: ParallelModel, fold_into=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (L2) over the whole model, whatever this rank holds of it; call after
    reduce_gradients. Returns the total norm (fp32), the same on every rank. fold_into: an optimiser whose next step
    applies the clip's coefficient itself (optim.adamw.AdamW.scale_next_step, optim.clip_in_step) instead of a
    multiply over the gradients here."""
    grads = [p.grad for p in params if p.grad is not None]
    # The compute device: host-resident Engram blocks (parallel.engram_host_memory) sum their squares there too.
    device = next((g.device for g in grads if g.device.type != "cpu"), grads[0].device if grads else None)
    # One multi-tensor norm per (shard groups, device, dtype) instead of a cast, a square and a sum per gradient (three
    # launches each, 1,800 a step on v41_small: BENCHMARKS.md, issue 16), accumulated in fp64 as before.
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        t = local_shard(g)
        buckets.setdefault((_shard_groups(g), t.device, t.dtype), []).append(t)
    squares: dict[tuple, torch.Tensor] = {}  # shard groups -> sum of squares of this rank's pieces
    for (key, _, _), ts in buckets.items():
        sq = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).square().sum().to(device)
        squares[key] = squares[key] + sq if key in squares else sq
    total = torch.zeros((), dtype=torch.float64, device=device)
    for groups, sq in squares.items():  # same parameter order, so the same keys in the same order, on every peer
        for group in groups:
            dist.all_reduce(sq, group=group)
        total += sq
    if pm.meshes is not None and pm.dims.pp > 1:
        dist.all_reduce(total, group=pm.meshes.pp.get_group())
    norm = total.sqrt().float()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's coefficient
    if fold_into is not None:
        fold_into.scale_next_step(coef)
        return norm
    for (_, dev, dtype), ts in buckets.items():
        torch._foreach_mul_(ts, coef.to(dev, dtype))
    return norm


@torch.no_grad()
def update_router_biases(pm: ParallelModel) -> float:
    """Aux-loss-free balancing after the optimiser step, from the load counts of every rank that routed different
    tokens (dp x ep x cp; tp peers routed the same ones); returns the worst max/mean expert load of the model."""
    moes = moe_layers(pm.module)
    if pm.meshes is None:
        counts = [moe.load_counts() for moe in moes]
    else:
        counts = reduce_load_counts(pm.module, pm.meshes)
    worst = max(moe.imbalance(c) for moe, c in zip(moes, counts))
    for moe, c in zip(moes, counts):
        moe.update_bias(counts=c)
    if pm.meshes is not None and pm.dims.pp > 1:  # each pipeline rank saw its own layers
        worst_t = torch.tensor(worst, dtype=torch.float64, device=counts[0].device)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=pm.meshes.pp.get_group())
        worst = float(worst_t)
    return worst


def reduce_load_counts(model: nn.Module, meshes) -> list[torch.Tensor]:
    """Every MoE layer's [2, E] load counts summed over the ranks that route different tokens through the same
    layers (dp_replicate x dp_shard x ep x cp: `meshes.dp_ep_cp`); cp is included because context-parallel ranks
    route different parts of a sequence."""
    counts = torch.stack([moe.load_counts() for moe in moe_layers(model)])  # [L, 2, E]
    group = meshes.dp_ep_cp.get_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return list(counts)


def reduce_over(pm: ParallelModel, values: list[float], mesh_name: str, mean: bool) -> list[float]:
    """Per-rank numbers summed (mean: averaged) over the ranks of mesh `mesh_name` (a `Meshes` field, e.g. "data",
    "dp_ep_cp"); as they are in a single process."""
    if pm.meshes is None or not values:
        return list(values)
    mesh = getattr(pm.meshes, mesh_name)
    device = next(iter(pm.module.parameters())).device
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if mesh.size() > 1:
        dist.all_reduce(t, group=mesh.get_group())
    if mean:
        t /= mesh.size()
    return t.tolist()


def mean_over_data(pm: ParallelModel, values: list[float]) -> list[float]:
    """Mean of per-rank numbers over the ranks that see different tokens (dp x ep x cp): the job's loss from each
    rank's mean loss (equal token counts per rank). tp and pp peers hold the same numbers already."""
    return reduce_over(pm, values, "dp_ep_cp", mean=True)


def sum_over_data(pm: ParallelModel, values: list[float]) -> list[float]:
    """Sum over the ranks that read different batches (dp x ep): per-reader counts such as skipped shards."""
    return reduce_over(pm, values, "data", mean=False)


def full_named_tensors(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of this rank's parameters (or their gradients), DTensors gathered: for tests and
    debugging. Every rank holding a piece of a DTensor must call it (collectives)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        out[name] = (t.full_tensor() if _is_dtensor(t) else t).clone()
    return out
