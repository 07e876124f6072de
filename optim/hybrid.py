"""One optimiser over groups of three kinds: AdamW, Muon (optim/muon.py) and Sinkhorn-balanced momentum
(optim/sinkhorn.py), built from `optim.rules` (optim/rules.py).

Contract: `Hybrid` is one torch.optim.Optimizer (one `state`, one `param_groups`, each group's `kind` naming its
update), so DCP saves, loads and reshards it as AdamW alone and the LR schedule scales every group alike. AdamW
groups run through torch's AdamW. On sharded parameters (DTensors) Muon orthogonalises a block where a rank holds it
whole, else on an owner rank chosen by cost (one gather of the update shards, one scatter back); Sinkhorn tables
balance over their shards with all-reduces; AdamW updates each shard. `local` is a DTensor's local shard.

Design and reasoning: docs/optim.md#the-hybrid-optimiser
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optim import muon as muon_lib
from optim import sinkhorn as sinkhorn_lib
from optim.adamw import AdamW


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a distributed parameter (a DTensor); any other tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


CHUNK = 1 << 27
"""Muon's values per batched Newton-Schulz call (134 M: a transient of about 1.3 GB)"""


class Hybrid(torch.optim.Optimizer):
    """Groups: dicts with `params`, `kind` ("adamw" / "muon" / "sinkhorn"), `lr`, `weight_decay`, and per kind:
    adamw: betas, eps; muon: momentum, nesterov, rms, head_rows (rows per head, or None); sinkhorn: momentum,
    nesterov, rms, iters. AdamW's options (fused / foreach) come as `adamw_options`."""

    groups_vary_by_layout = True
    """its groups are the rules' with parameters on this rank: checkpoints key them by parameter name
    (trainer/checkpoint/checkpointer.py)"""

    def __init__(self, groups: list[dict], adamw_options: dict | None = None):
        super().__init__(groups, {"lr": 1e-3, "weight_decay": 0.0})
        adam_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self._adamw = AdamW(adam_groups, **(adamw_options or {})) if adam_groups else None
        self._owners: dict[int, _Owner] = {}
        self._groups: dict = {}  # process groups of the meshes' ranks, for the owners' gathers
        self._plan_owners()

    # -- Muon under sharding: owners -----------------------------------------------------------------------------
    def _plan_owners(self) -> None:
        """An owner per sharded Muon matrix whose blocks no rank holds whole, balanced by cost per mesh."""
        load: dict = {}
        todo = []
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            for p in group["params"]:
                if getattr(p, "device_mesh", None) is not None and not _blocks_local(p, group["head_rows"]):
                    nb, m, n = muon_lib.block_shape(p.shape, group["head_rows"])
                    todo.append((nb * m * n * min(m, n), p))
        for cost, p in sorted(todo, key=lambda x: -x[0]):
            ranks = p.device_mesh.mesh.flatten().tolist()
            key = tuple(ranks)
            loads = load.setdefault(key, {r: 0 for r in ranks})
            owner = min(ranks, key=lambda r: (loads[r], r))
            loads[owner] += cost
            self._owners[id(p)] = _Owner(p, owner, self._groups)

    # -- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
            self._adamw.state = self.state
            self._adamw.step()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
            elif group["kind"] == "sinkhorn":
                self._sinkhorn(group)
        return loss

    def _muon(self, group: dict) -> None:
        """Momentum, Newton-Schulz and the update, in chunks of at most CHUNK values of parameters whose blocks have
        one shape (one batched iteration each), so the step's transient (the fp32 Nesterov updates, the bf16
        stacked blocks and iterates: about 10 B a value) is bounded by a chunk, not by the group."""
        with_grad = [p for p in group["params"] if p.grad is not None]
        owned = [p for p in with_grad if id(p) in self._owners]
        by_shape: dict[tuple, list] = {}
        for p in with_grad:
            if id(p) not in self._owners:
                by_shape.setdefault(muon_lib.block_shape(local(p).shape, group["head_rows"])[1:], []).append(p)
        for ps in by_shape.values():
            chunk, size = [], 0
            for p in ps + [None]:
                if p is not None and (not chunk or size + local(p).numel() <= CHUNK):
                    chunk.append(p)
                    size += local(p).numel()
                    continue
                us = [self._nesterov(q, group) for q in chunk]
                factors = muon_lib.orthogonal_factors(us, [group["head_rows"]] * len(us), group["rms"])
                del us
                for q, (o, scale) in zip(chunk, factors):
                    self._apply(q, o, scale, group)
                chunk, size = ([p], local(p).numel()) if p is not None else ([], 0)
        for p in owned:
            o = self._owners[id(p)].orthogonalise(self._nesterov(p, group), group["head_rows"], group["rms"])
            self._apply(p, o, 1.0, group)

    def _nesterov(self, p, group: dict) -> torch.Tensor:
        """The momentum buffer updated with p's gradient; the update to orthogonalise (local shard, fp32)."""
        g = local(p.grad).float()
        state = self.state[p]
        if "momentum_buffer" not in state:  # (a DTensor like p: checkpoints reshard it as they do p)
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = local(state["momentum_buffer"])
        buf.mul_(group["momentum"]).add_(g)
        return g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()

    @staticmethod
    def _apply(p, o: torch.Tensor, scale: float, group: dict) -> None:
        w = local(p)
        if group["weight_decay"]:
            w.mul_(1 - group["lr"] * group["weight_decay"])
        w.add_(o, alpha=-group["lr"] * scale)  # (o in bf16 on a GPU: promoted inside the add)

    def _sinkhorn(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            w = local(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            sharded = getattr(p, "device_mesh", None) is not None
            if p.grad is None and not sharded:
                continue
            if w.ndim != 2:
                raise ValueError(f"Sinkhorn momentum takes [rows, D] tables, got shape {tuple(p.shape)}")
            reducer = sinkhorn_lib.ShardSums(p)
            g = local(p.grad) if p.grad is not None else torch.zeros_like(w)
            touched = g.ne(0).any(dim=1)
            if reducer.groups[1]:  # column shards: a row is touched if any shard's part of it is
                touched = reducer.sum(touched.to(torch.int32), 1) > 0
            rows = touched.nonzero().squeeze(1)
            if rows.numel() == 0 and not sharded:
                continue
            buf = local(state["momentum_buffer"])
            gr = g.index_select(0, rows).float()
            m = buf.index_select(0, rows).mul_(mu).add_(gr)
            buf.index_copy_(0, rows, m)
            u = gr.add(m, alpha=mu) if group["nesterov"] else m
            upd = sinkhorn_lib.balance(u, group["iters"], group["rms"], reducer=reducer, total_cols=p.shape[1])
            new = w.index_select(0, rows).float()
            if wd:
                new.mul_(1 - lr * wd)
            new.add_(upd, alpha=-lr)
            w.index_copy_(0, rows, new.to(w.dtype))


def _blocks_local(p, head_rows: int | None) -> bool:
    """Whether every Muon block of the DTensor p lies whole on each rank: replicated, or sharded only on dim 0 where
    dim 0 indexes whole blocks (stacked experts; heads whose count the shards split evenly)."""
    shards = [pl for pl in p.placements if pl.is_shard()]
    if not shards:
        return True
    if any(pl.dim != 0 for pl in shards) or any(not (pl.is_shard() or pl.is_replicate()) for pl in p.placements):
        return False
    ways = 1
    for mesh_dim, pl in enumerate(p.placements):
        if pl.is_shard():
            ways *= p.device_mesh.size(mesh_dim)
    if p.ndim == 3 and head_rows is None:
        return p.shape[0] % ways == 0
    if p.ndim == 2 and head_rows is not None:
        return (p.shape[0] // head_rows) % ways == 0
    return False


class _Owner:
    """One sharded matrix's owner: the rank that orthogonalises it whole. Every rank of the parameter's mesh sends
    its shard to the owner (gather) and receives its shard of the result back (scatter), over a process group of
    the mesh's ranks."""

    def __init__(self, p, owner: int, groups: dict):
        self.shape, self.owner = tuple(p.shape), owner
        self.ranks = p.device_mesh.mesh.flatten().tolist()
        key = tuple(self.ranks)
        if key not in groups:  # (only the mesh's ranks call this: pipeline stages hold other parameters)
            groups[key] = (p.device_mesh.get_group() if p.device_mesh.ndim == 1 else
                           dist.new_group(self.ranks, use_local_synchronization=True))
        self.group = groups[key]
        # every rank's (shape, offset) of the shard it holds, the same arithmetic on every rank
        self.slices = []
        coords = {int(p.device_mesh.mesh[idx]): idx for idx in itertools.product(*map(range, p.device_mesh.shape))}
        for rank in self.ranks:
            shape, offset = _shard_of(p, coords[rank])
            self.slices.append(tuple(slice(o, o + s) for o, s in zip(offset, shape)))
        self.numel = max(_numel(s) for s in self.slices)

    def orthogonalise(self, u: torch.Tensor, head_rows: int | None, rms: float) -> torch.Tensor:
        me = dist.get_rank()
        flat = torch.zeros(self.numel, dtype=torch.float32, device=u.device)
        flat[:u.numel()] = u.reshape(-1)
        parts = [torch.empty_like(flat) for _ in self.ranks] if me == self.owner else None
        dist.gather(flat, parts, dst=self.owner, group=self.group)
        out = torch.empty_like(flat)
        outs = None
        if me == self.owner:
            full = torch.empty(self.shape, dtype=torch.float32, device=u.device)
            for part, sl in zip(parts, self.slices):
                full[sl] = part[:_numel(sl)].view([s.stop - s.start for s in sl])
            full = muon_lib.orthogonalise([full], [head_rows], rms)[0]
            outs = []
            for sl in self.slices:
                o = torch.zeros_like(flat)
                o[:_numel(sl)] = full[sl].reshape(-1)
                outs.append(o)
        dist.scatter(out, outs, src=self.owner, group=self.group)
        return out[:u.numel()].view(u.shape)


def _numel(sl) -> int:
    n = 1
    for s in sl:
        n *= s.stop - s.start
    return n


def _shard_of(p, coord):
    """(local shape, global offset) of the shard the rank at mesh coordinate `coord` holds: DTensor's Shard splits
    as torch.chunk does (ceil-sized chunks, the last ones smaller or empty), mesh dims left to right."""
    from torch.distributed.tensor import Shard

    shape, offset = list(p.shape), [0] * p.ndim
    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            n = p.device_mesh.size(mesh_dim)
            size = shape[pl.dim]
            chunk = -(-size // n)
            start = min(chunk * coord[mesh_dim], size)
            stop = min(start + chunk, size)
            offset[pl.dim] += start
            shape[pl.dim] = stop - start
    return tuple(shape), tuple(offset)
