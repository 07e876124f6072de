"""Sinkhorn-balanced Nesterov momentum for the token embedding, the output head and the Engram tables (SPEC 1.7).

One momentum buffer per table, no second moment. Each step touches only the rows whose gradient is nonzero (the
tokens and n-grams the step saw): their momentum is updated, and the Nesterov update of those rows, a [R, D] block,
is balanced by alternating normalisations of its row RMS and its column RMS (a Sinkhorn iteration on the squared
entries), then scaled so both are `rms`. Rows the step did not touch keep their values and their momentum bit for
bit (decoupled weight decay included: an unseen row does not decay), and the optimiser's arithmetic runs on the R
touched rows only. Finding them reads the gradient once (autograd leaves a dense [N, D] gradient for an embedding).

Sharded tables (DTensors): a row-sharded table (Shard(0): the Engram tables' row sharding, a vocabulary-parallel
embedding or head) balances columns over the touched rows of every shard (one all-reduce of D sums of squares and
a count per iteration), rows locally; a column-sharded one (Shard(1)) the other way round; a replicated one
locally. No rank gathers a table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ITERS = 8
"""alternating row / column normalisations per step (the test: both RMS within 1e-3 of the target)"""

RMS = 0.2
"""the balanced update's row and column RMS: AdamW's typical update RMS, as Muon's (optim/muon.py)"""


class ShardSums:
    """Sums over the shards of a sharded table's rows (dim 0) or columns (dim 1): None where the dim is whole."""

    def __init__(self, param: torch.Tensor):
        self.groups: dict[int, list] = {0: [], 1: []}
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            return
        for mesh_dim, placement in enumerate(param.placements):
            if placement.is_shard():
                d = placement.dim
                if d not in (0, 1):
                    raise ValueError(f"Sinkhorn momentum: a table sharded on dim {d} (rows or columns only)")
                self.groups[d].append(mesh.get_group(mesh_dim))
            elif not placement.is_replicate():
                raise ValueError(f"Sinkhorn momentum: a table with placement {placement} (shards or replicas only)")

    def sum(self, t: torch.Tensor, sharded_dim: int) -> torch.Tensor:
        for group in self.groups[sharded_dim]:
            dist.all_reduce(t, group=group)
        return t


def balance(u: torch.Tensor, iters: int = ITERS, rms: float = RMS, eps: float = 1e-12,
            reducer: ShardSums | None = None, total_cols: int | None = None) -> torch.Tensor:
    """u [R, D] fp32 -> the same entries rescaled per row and per column so that every row and every column has RMS
    `rms` (to the iteration's convergence; the columns exactly after the last step). With a reducer, u is one
    shard of the rows (or columns) and the sums it needs run over all shards.

    The iteration keeps the scales, not the matrix: with u' = r_i u_ij c_j, a row's sum of squares is
    r_i^2 (u^2 c^2)_i and a column's c_j^2 (r^2 u^2)_j, so each half-step sets r^2 = D / (u^2 c^2) and
    c^2 = R / (r^2 u^2): two matrix-vector products over u^2 per step, and u' formed once at the end. (An all-zero
    row or column keeps a finite scale: the floor eps on its sum.)"""
    reducer = reducer or ShardSums(u)
    u = u.float()
    sq = u.square()
    rows = torch.tensor(float(u.shape[0]), device=u.device)
    reducer.sum(rows, 0)  # touched rows over every row shard
    cols = float(total_cols if total_cols is not None else u.shape[1])
    c2 = torch.ones(u.shape[1], device=u.device)
    for _ in range(iters):
        r2 = cols / reducer.sum(sq @ c2, 1).clamp_min(eps)  # [R]: a row's entries may lie on several column shards
        c2 = rows / reducer.sum(r2 @ sq, 0).clamp_min(eps)  # [D]
    return u * (r2.sqrt() * rms)[:, None] * c2.sqrt()[None, :]
