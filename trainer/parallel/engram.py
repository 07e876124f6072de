"""Engram row sharding: each rank of a group holds a contiguous block of every Engram table's rows; lookups travel.

Contract: `apply_engram_sharding` makes each table a DTensor sharded on dim 0 over the group (rank r owns rows
[r * N_r, min((r + 1) * N_r, N)) of N, N_r = ceil(N / W) over W ranks; DCP checkpoints load into any layout) and
installs a `ShardedRows` reader in `Engram.lookup`; forward rows are exact copies, no rank forms a whole-table
gradient.
Every rank of the group must run the same lookups in the same order (forward and backward), as with EP.
`EngramSharding.prefetch(input_ids)` may issue a micro-batch's exchange early; a lookup for other ids raises.
After backward call `reduce_engram_gradients(model, num_loss_ranks)` (usually `meshes.dp_ep_cp.size()`);
`engram_tables(model)` must be kept out of the replicated all-reduce and out of FSDP
(fully_shard(..., ignored_params=set(engram_tables(model)))). `host_memory=True` keeps the blocks in host memory.

Design and reasoning: docs/parallelism.md#engram-row-sharding
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from model.common import local
from model.engram import Engram
from model.forward import SequenceShard, new_state

__all__ = [
    "EngramSharding", "ShardedRows", "RowFetch", "apply_engram_sharding", "engram_tables", "reduce_engram_gradients",
]


def _as_mesh(mesh_or_group) -> DeviceMesh:
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"apply_engram_sharding wants a 1-D mesh (e.g. Meshes.dp_ep_cp), got {mesh_or_group.ndim}"
                             " dims")
        return mesh_or_group
    device_type = "cuda" if dist.get_backend(mesh_or_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(mesh_or_group, device_type)


# --- one exchange ----------------------------------------------------------------------------------------------------

@dataclass
class RowFetch:
    """One issued exchange: what the lookup needs to finish it and what its backward needs to send gradients home."""

    row_ids: torch.Tensor  # [...] the ids asked for (a prefetched fetch is checked against the lookup's)
    inverse: torch.Tensor  # [M] position -> its distinct row (index into the U rows)
    serve: torch.Tensor  # [R] block-local rows this rank served, source-rank major (on the block's device)
    send_splits: list[int]  # [W] distinct ids this rank asked each owner for
    recv_splits: list[int]  # [W] ids each requester asked this rank for
    rows: torch.Tensor  # [U, Dh] the distinct rows, valid once `work` has completed
    work: Any  # the rows' all-to-all in flight (None once waited on)
    version: int  # the block's version counter at issue: a later in-place update makes `rows` stale

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.rows


def _block_version(block: torch.Tensor) -> int:
    # to_local() hands out a view; views share the base's version counter, which every in-place update bumps.
    return block._version


class _ShardedLookup(torch.autograd.Function):
    """(block [N_r, Dh], fetch) -> rows [..., Dh]; the backward returns the block's gradient (touched rows only)."""

    @staticmethod
    def forward(ctx, block, fetch: RowFetch, group):
        rows = fetch.wait()
        ctx.group, ctx.block_shape, ctx.block_device = group, block.shape, block.device
        ctx.inverse, ctx.serve, ctx.num_unique = fetch.inverse, fetch.serve, rows.shape[0]
        ctx.send_splits, ctx.recv_splits = fetch.send_splits, fetch.recv_splits
        return rows.index_select(0, fetch.inverse).view(*fetch.row_ids.shape, rows.shape[1])

    @staticmethod
    def backward(ctx, grad):
        dh = grad.shape[-1]
        # Repeats summed in position order first: the owner then receives one row per distinct id and requester.
        # index_put_(accumulate) adds one term at a time in the table dtype, as F.embedding's backward does (CPU
        # index_add_ accumulates bf16 in fp32, which would round differently from the unsharded module).
        g_unique = grad.new_zeros(ctx.num_unique, dh).index_put_((ctx.inverse,), grad.reshape(-1, dh),
                                                                 accumulate=True)
        g_served = grad.new_empty(sum(ctx.recv_splits), dh)
        dist.all_to_all_single(g_served, g_unique.contiguous(), ctx.recv_splits, ctx.send_splits, group=ctx.group)
        g_block = torch.zeros(ctx.block_shape, dtype=grad.dtype, device=ctx.block_device)
        g_block.index_put_((ctx.serve,), g_served.to(ctx.block_device), accumulate=True)  # source-rank order
        return g_block, None, None


class ShardedRows:
    """The `row_reader` of one Engram: rows [first_row, first_row + num_local) live here, the rest on the group."""

    def __init__(self, mesh: DeviceMesh, num_rows: int, *, verify_prefetch: bool = True):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.num_ranks, self.rank = mesh.size(), mesh.get_local_rank()
        self.num_rows = num_rows
        self.rows_per_rank = -(-num_rows // self.num_ranks)  # torch.chunk's split (DTensor's Shard(0))
        self.first_row = min(self.rank * self.rows_per_rank, num_rows)
        self.num_local = min(num_rows, self.first_row + self.rows_per_rank) - self.first_row
        self.verify_prefetch = verify_prefetch
        self.pending: collections.deque[RowFetch] = collections.deque()

    @torch.no_grad()
    def issue(self, block: torch.Tensor, row_ids: torch.Tensor) -> RowFetch:
        """Start the exchange for row_ids (global ids, any shape, on the compute device); the rows' all-to-all is
        left in flight. Collective over the group: every rank issues its own ids at the same point."""
        device = row_ids.device
        unique, inverse = torch.unique(row_ids.reshape(-1), sorted=True, return_inverse=True)  # [U], [M]
        owner = torch.div(unique, self.rows_per_rank, rounding_mode="floor")  # sorted ids -> owners ascending
        send_counts = torch.bincount(owner, minlength=self.num_ranks)  # raises on a negative id
        if send_counts.numel() != self.num_ranks:
            raise IndexError(f"Engram row id {int(unique[-1])} is outside the table's {self.num_rows} rows")
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        asked = unique.new_empty(sum(recv_splits))  # [R] source-rank major
        dist.all_to_all_single(asked, unique, recv_splits, send_splits, group=self.group)
        serve = (asked - self.first_row).to(block.device)
        if block.device.type == "cpu" and device.type == "cuda":
            # Host-resident block: gather into pinned memory so the copy to the device can overlap.
            served = torch.empty((serve.numel(), block.shape[1]), dtype=block.dtype, pin_memory=True)
            torch.index_select(block, 0, serve, out=served)
            served = served.to(device, non_blocking=True)
        else:
            served = block.index_select(0, serve).to(device)
        rows = served.new_empty((unique.numel(), block.shape[1]))  # [U, Dh]
        work = dist.all_to_all_single(rows, served, send_splits, recv_splits, group=self.group, async_op=True)
        return RowFetch(row_ids, inverse, serve, send_splits, recv_splits, rows, work, _block_version(block))

    def prefetch(self, table: torch.Tensor, row_ids: torch.Tensor) -> None:
        """Issue the exchange for a later `lookup` of the same ids (consumed first in, first out)."""
        self.pending.append(self.issue(local(table).detach(), row_ids))

    def _take(self, block: torch.Tensor, row_ids: torch.Tensor) -> RowFetch:
        if not self.pending:
            return self.issue(block.detach(), row_ids)
        fetch = self.pending.popleft()
        if fetch.row_ids.shape != row_ids.shape or (self.verify_prefetch and not torch.equal(fetch.row_ids, row_ids)):
            fetch.wait()  # complete the collective every rank issued before failing
            raise RuntimeError(
                "Engram lookup asks for other rows than the prefetched ones: prefetch the micro-batches in the order "
                f"the forwards run (prefetched ids of shape {tuple(fetch.row_ids.shape)}, "
                f"asked {tuple(row_ids.shape)})")
        if fetch.version != _block_version(block):
            fetch.wait()  # the stale exchange must still complete on every rank before the next one
            fetch = self.issue(block.detach(), row_ids)
        return fetch

    def __call__(self, table: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        block = local(table)  # autograd-aware: the block's gradient reaches the DTensor parameter
        if isinstance(row_ids, DTensor):
            # Under tensor parallelism Engram runs in DTensor form, replicated over tp: every tp rank looks up the
            # same rows in its own group (the group holds no tp peer, so no block sees a contribution twice).
            ids = row_ids.to_local()
            rows = _ShardedLookup.apply(block, self._take(block, ids), self.group)
            return DTensor.from_local(rows, row_ids.device_mesh, row_ids.placements, run_check=False)
        return _ShardedLookup.apply(block, self._take(block, row_ids), self.group)


# --- applying it to a model ------------------------------------------------------------------------------------------

def _engrams(model: nn.Module) -> list[Engram]:
    return [m for m in model.modules() if isinstance(m, Engram)]


def _install_block(engram: Engram, block: torch.Tensor, reader: ShardedRows) -> None:
    shard = DTensor.from_local(block, reader.mesh, [Shard(0)], run_check=False,
                               shape=torch.Size((reader.num_rows, block.shape[1])), stride=(block.shape[1], 1))
    engram.register_parameter("table", nn.Parameter(shard, requires_grad=engram.table.requires_grad))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return t
    t = t.to("cpu")
    return t.pin_memory() if torch.cuda.is_available() else t


@dataclass
class EngramSharding:
    """What apply_engram_sharding installed: one reader per Engram, by model layer."""

    model: nn.Module
    readers: dict[int, ShardedRows]
    host_memory: bool
    replica_group: Any = None  # ranks holding the same blocks (their row gradients are summed); None: none

    def _engram(self, layer: int) -> Engram:
        return next(m for m in _engrams(self.model) if m.layer_id == layer)

    def to_host(self, within: nn.Module | None = None) -> None:
        """Move every block (or those of the Engrams inside `within`) to host memory (pinned when CUDA is
        available). apply_engram_sharding does it on a materialised model; after a meta build call it once
        `to_empty` and `init_weights` ran, before fully_shard and the optimiser (it replaces the parameters)."""
        inside = None if within is None else {m.layer_id for m in _engrams(within)}
        for layer, reader in self.readers.items():
            if inside is None or layer in inside:
                engram = self._engram(layer)
                _install_block(engram, _to_host(local(engram.table).detach()), reader)

    def prefetch_row_ids(self, row_ids: dict[int, torch.Tensor]) -> None:
        """Issue the exchange of every sharded Engram for {model layer: row ids [B, T, C]} (the ids its forward will
        look up, e.g. from `model.forward.new_state`)."""
        for layer, reader in self.readers.items():
            reader.prefetch(self._engram(layer).table, row_ids[layer])

    def prefetch(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> None:
        """Issue the exchanges of the forward on input_ids [B, T] (this process's tokens), hashed as the model's
        forward hashes them (its hasher and sequence shard). A pipeline stage without the hasher (Engram layers
        behind the first stage get their row ids across the cut) uses `prefetch_row_ids`."""
        hasher = getattr(self.model, "hasher", None)
        if hasher is None:
            raise ValueError("EngramSharding.prefetch: this module has no Engram hasher; use prefetch_row_ids")
        shard = getattr(self.model, "sequence_shard", None) or SequenceShard()
        _, engram_in = new_state(self.model.cfg, input_ids, shard, hasher, image_mask)
        self.prefetch_row_ids({layer: engram_in[layer][0] for layer in self.readers})


def apply_engram_sharding(model: nn.Module, mesh_or_group, *, host_memory: bool = False,
                          verify_prefetch: bool = True) -> EngramSharding:
    """Shard every Engram table of `model` by rows over `mesh_or_group` (a 1-D DeviceMesh such as Meshes.dp_ep_cp,
    or a ProcessGroup) and route its lookups through the all-to-all row exchange. Returns the handle that prefetches.

    Call it on the meta-built model, before to_empty and init_weights: Engram.init_weights then draws this rank's
    rows with the single process's values (model.engram.init_table_rows_). On a materialised model each rank keeps
    the rows it had. A group of one rank works too (its exchange is a local copy), e.g. for host_memory alone.
    """
    mesh = _as_mesh(mesh_or_group)
    readers: dict[int, ShardedRows] = {}
    for engram in _engrams(model):
        if engram.row_reader is not None:
            raise ValueError(f"Engram of layer {engram.layer_id} already has a row reader")
        table = engram.table
        if isinstance(table, DTensor) and any(not pl.is_replicate() for pl in table.placements):
            raise ValueError(f"Engram of layer {engram.layer_id}: its table is already sharded ({table.placements}); "
                             "apply_engram_sharding before FSDP, and keep the tables out of fully_shard "
                             "(ignored_params=engram_tables(model))")
        reader = ShardedRows(mesh, engram.num_rows, verify_prefetch=verify_prefetch)
        # A table replicated by tensor parallelism holds every row locally; the block becomes a DTensor on the
        # group's mesh only (tp ranks hold identical blocks).
        block = local(table).detach()[reader.first_row:reader.first_row + reader.num_local].clone()
        _install_block(engram, _to_host(block) if host_memory else block, reader)
        engram.row_reader = reader
        readers[engram.layer_id] = reader
    return EngramSharding(model, readers, host_memory)


def engram_tables(model: nn.Module) -> list[nn.Parameter]:
    """The Engram tables a reader shards (leave them out of replicated-gradient reductions and norms)."""
    return [m.table for m in _engrams(model) if isinstance(m.row_reader, ShardedRows)]


@torch.no_grad()
def reduce_engram_gradients(model: nn.Module, num_loss_ranks: int, replica_group=None) -> None:
    """Turn each sharded table's block gradient (the sum of every group rank's loss gradient) into the gradient of
    the job's loss, the mean of num_loss_ranks per-rank losses: sum over `replica_group` (ranks outside the group
    holding the same block, e.g. cp ranks when the group is Meshes.data), then divide by num_loss_ranks.

    A table no rank of the group looked up keeps grad None only if that holds on every rank: a rank whose ids all
    missed its own block still got a (zero) gradient from the backward, so grads are None everywhere or nowhere.
    """
    for table in engram_tables(model):
        if table.grad is None:
            continue
        g = local(table.grad)
        if replica_group is not None and dist.get_world_size(replica_group) > 1:
            dist.all_reduce(g, group=replica_group)
        g.div_(num_loss_ranks)
