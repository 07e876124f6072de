"""Expert parallelism (EP): each rank of the `ep` mesh axis holds E/ep routed experts; tokens travel to them.

Contract: `apply_ep` makes rank r own experts [r * E_local, (r + 1) * E_local) of every MoE layer (w1/w3/w2
DTensors, Shard(0) over the ep mesh; DCP checkpoints load into any layout) and installs an all-to-all dispatcher.
Dropless by default (one host sync per layer, in the forward). With parallel.ep_capacity_factor = f > 0 every
message has a fixed size (no host sync, static shapes): copies beyond C = ceil(f * S / W) per destination rank are
dropped (`dropped_copies`, `dropped_share`), and every ep rank must route the same number of copies S.
Gradients (trainer/parallel/gradients.py): non-expert ones are averaged over dp x ep x cp; an expert's
(`expert_parameters`) is summed over dp and cp and divided by dp x ep x cp.

Design and reasoning: docs/parallelism.md#expert-parallelism
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from model.moe import GroupedExperts, LocalDispatcher, MoE, expert_counts, gather_rows, inverse_permutation

_EXPERT_WEIGHTS = ("w1", "w3", "w2")


# --- autograd-aware all-to-alls ------------------------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _pack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [S, D], w [S] fp32 -> [S, D + c]: w's bytes appended as c columns of x's dtype (exact, no rounding)."""
    if 4 % x.element_size() == 0:
        # The dtype view on the 1-D vector (stride 1): Inductor refuses it on a [S, 1] view, whose last stride is 0.
        cols = w.float().contiguous().view(x.dtype).view(w.shape[0], 4 // x.element_size())  # [S, 4 / itemsize]
    else:  # a wider dtype (fp64) holds every fp32 value exactly
        cols = w[:, None].to(x.dtype)
    return torch.cat([x, cols], dim=1)


def _unpack(buf: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, cols = buf[:, :dim], buf[:, dim:]
    if 4 % buf.element_size() == 0:
        return x, cols.contiguous().view(torch.float32)[:, 0]
    return x, cols[:, 0].float()


class _TokensAllToAll(torch.autograd.Function):
    """Sends token rows x [S, D] and their fp32 routing weights w [S] in one message; the backward sends both
    gradients back the same way. One node for both, so every rank issues its collectives in the same order."""

    @staticmethod
    def forward(ctx, x, w, out_splits, in_splits, group):
        ctx.splits, ctx.group, ctx.dim = (out_splits, in_splits), group, x.shape[1]
        return _unpack(_all_to_all(_pack(x, w), out_splits, in_splits, group), x.shape[1])

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        out_splits, in_splits = ctx.splits
        # grad_w arrives in fp32 (w is fp32); grads missing on this rank are materialised as zeros by autograd.
        back = _all_to_all(_pack(grad_x, grad_w), in_splits, out_splits, ctx.group)
        gx, gw = _unpack(back, ctx.dim)
        return gx, gw, None, None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its transpose (the same exchange with the splits swapped) as the backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _equal_all_to_all(x: torch.Tensor, group_name: str, num_ranks: int) -> torch.Tensor:
    """all_to_all_single with equal splits (block r of x's rows to rank r; block s of the output from rank s), as a
    functional collective: traceable by dynamo and differentiable (its registered backward is the same exchange)."""
    splits = [x.shape[0] // num_ranks] * num_ranks
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _EqualTokensAllToAll(torch.autograd.Function):
    """_TokensAllToAll with equal splits and functional collectives: rows x [W*C, D] and fp32 weights w [W*C] in one
    message, both gradients back in one. Its own node because the packing reinterprets bytes (not differentiable)."""

    @staticmethod
    def forward(ctx, x, w, group_name, num_ranks):
        ctx.group_name, ctx.num_ranks, ctx.dim = group_name, num_ranks, x.shape[1]
        return _unpack(_equal_all_to_all(_pack(x, w), group_name, num_ranks), x.shape[1])

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        back = _equal_all_to_all(_pack(grad_x, grad_w), ctx.group_name, ctx.num_ranks)
        gx, gw = _unpack(back, ctx.dim)
        return gx, gw, None, None


# --- the dispatcher ------------------------------------------------------------------------------------------------

@dataclass
class EPHandle:
    """What combine needs to bring expert outputs home."""

    order: torch.Tensor  # [S] the local sort of this rank's copies by global expert (LocalDispatcher's handle)
    send_splits: list[int]  # [W] copies this rank sent to each rank
    recv_splits: list[int]  # [W] copies this rank received from each rank
    regroup: torch.Tensor  # [R] received rows (source-rank major) -> local-expert-major order


@dataclass
class CapacityHandle:
    """What the sync-free combine needs (C rows per rank pair, R = W * C rows received)."""

    slot: torch.Tensor  # [S] the send-buffer row of each of this rank's copies (copy order n*K + k), clamped
    kept: torch.Tensor  # [S] bool: the copy was sent (not dropped)
    regroup: torch.Tensor  # [R] received rows (source-rank major, C each) -> local-expert-major order, padding last
    valid: torch.Tensor  # [R] bool, source-rank major: the row holds a copy (not padding)


class AllToAllDispatcher:
    """All-to-all dispatch with LocalDispatcher's interface (model/moe.py): dropless by default, sync-free with
    fixed-size messages when capacity_factor > 0.

    dispatch(x [N, D], topk_idx [N, K] global ids, topk_weights [N, K]) ->
      (x_recv [R, D], weights_recv [R], tokens_per_expert [E_local] int64, EPHandle);
    combine(y [R, D], handle, N) -> [N, D] fp32.
    Received rows are ordered by local expert, then source rank, then the source's token order: the same rows
    in the same order as LocalDispatcher gives those experts when one process holds every rank's tokens
    (concatenated in ep-rank order), so the expert GEMMs see identical inputs.

    capacity_factor > 0: the sync-free mode (docs/parallelism.md). Then R = W * C always, the valid rows come first
    in the order above and tokens_per_expert counts only them; the padding rows after them are zero on arrival and
    whatever the experts make of them never leaves this rank. `dropped` holds the number of this rank's copies
    the last dispatch dropped (0-dim int64 on the device; always 0 when dropless).
    """

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int, capacity_factor: float = 0.0) -> None:
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep size {self.num_ranks}")
        if not capacity_factor >= 0:
            raise ValueError(f"parallel.ep_capacity_factor must be >= 0, got {capacity_factor!r}")
        self.num_experts = num_experts
        self.num_local = num_experts // self.num_ranks
        self.capacity_factor = float(capacity_factor)
        self.group_name = ep_group.group_name
        self.local = LocalDispatcher(num_experts)  # the sort by global expert is also the sort by owning rank
        self.dropped: torch.Tensor | None = None

    def capacity(self, num_copies: int) -> int:
        """C: rows this rank sends to each ep rank, for S = num_copies copies (sync-free mode)."""
        if self.capacity_factor >= self.num_ranks:
            return num_copies
        return min(num_copies, math.ceil(self.capacity_factor * num_copies / self.num_ranks))

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        if self.capacity_factor > 0:
            return self._dispatch_sync_free(x, topk_idx, topk_weights)
        return self._dispatch_dropless(x, topk_idx, topk_weights)

    def combine(self, y: torch.Tensor, handle: EPHandle | CapacityHandle, num_tokens: int) -> torch.Tensor:
        if isinstance(handle, CapacityHandle):
            return self._combine_sync_free(y, handle, num_tokens)
        return self._combine_dropless(y, handle, num_tokens)

    # --- dropless: variable splits through the host ---------------------------------------------------------------

    def _dispatch_dropless(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
        num_ranks, e_local = self.num_ranks, self.num_local
        x_send, w_send, counts, order = self.local.dispatch(x, topk_idx, topk_weights)  # [S, D], [S], [E], [S]
        # Exchange counts first: block s of recv_counts is what rank s sends to each of this rank's experts.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(num_ranks, e_local)  # [W, E_local]
        send_splits = counts.view(num_ranks, e_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        x_recv, w_recv = _TokensAllToAll.apply(x_send, w_send, recv_splits, send_splits, self.group)  # [R, ...]
        # Rows arrive source-rank major; a stable sort by local expert keeps source rank, then source order.
        expert_of_row = torch.arange(e_local, device=x.device).repeat(num_ranks).repeat_interleave(
            recv_counts.reshape(-1))  # [R]
        regroup = torch.argsort(expert_of_row, stable=True)
        handle = EPHandle(order, send_splits, recv_splits, regroup)
        self.dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        return gather_rows(x_recv, regroup), w_recv.index_select(0, regroup), recv_counts.sum(0), handle

    def _combine_dropless(self, y: torch.Tensor, handle: EPHandle, num_tokens: int) -> torch.Tensor:
        y_src = gather_rows(y, inverse_permutation(handle.regroup), handle.regroup)  # [R] back to source-rank major
        y_home = _AllToAll.apply(y_src, handle.send_splits, handle.recv_splits, self.group)  # [S, D]
        return self.local.combine(y_home, handle.order, num_tokens)  # fp32 sum of the K copies, fixed order

    # --- sync-free: fixed C rows per rank pair --------------------------------------------------------------------

    def _dispatch_sync_free(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CapacityHandle]:
        num_ranks, e_local = self.num_ranks, self.num_local
        n, k = topk_idx.shape
        s = n * k
        cap = self.capacity(s)  # C, a Python int: the shapes below depend on the input's shape only
        dev = x.device
        flat_idx = topk_idx.reshape(-1)  # [S]
        order = torch.argsort(flat_idx, stable=True)  # [S] LocalDispatcher's sort: by global expert, then copy
        counts = expert_counts(flat_idx, self.num_experts).view(num_ranks, e_local)  # [W, E_local]
        per_rank = counts.sum(1)  # [W] copies for each destination
        rank_start = per_rank.cumsum(0) - per_rank  # [W] where each destination's copies start in `order`
        # Kept copies: the first C of each destination's (in sorted order), i.e. per (destination, local expert)
        # the part of the count below C once the destination's lower experts are counted.
        before = counts.cumsum(1) - counts  # [W, E_local]
        sent_counts = (cap - before).clamp(min=0).minimum(counts)  # [W, E_local], sums to <= C per destination
        # Send buffer, slot (r, j) of [W, C]: the j-th copy for rank r in sorted order, if j < its kept count.
        j = torch.arange(cap, device=dev)
        slot_valid = j[None, :] < sent_counts.sum(1)[:, None]  # [W, C]
        sorted_pos = (rank_start[:, None] + j[None, :]).clamp(max=max(s - 1, 0))  # [W, C], clamped where invalid
        copy = order.index_select(0, sorted_pos.reshape(-1))  # [W*C] copy index n*K + k of each slot
        slot_valid = slot_valid.reshape(-1)
        x_send = torch.where(slot_valid[:, None], x.index_select(0, copy // k), 0)  # [W*C, D], zero padding
        w_send = torch.where(slot_valid, topk_weights.reshape(-1).index_select(0, copy), 0)  # [W*C] fp32
        # The way home: each copy's slot. Position of sorted copy i within its destination's block: i - rank_start.
        sorted_rank = flat_idx.index_select(0, order) // e_local  # [S]
        pos = torch.arange(s, device=dev) - rank_start.index_select(0, sorted_rank)  # [S]
        kept_sorted = pos < cap
        slot_sorted = (sorted_rank * cap + pos).clamp(max=max(num_ranks * cap - 1, 0))
        slot = torch.empty_like(order).scatter_(0, order, slot_sorted)  # [S] in copy order
        kept = torch.empty_like(kept_sorted).scatter_(0, order, kept_sorted)
        self.dropped = s - kept_sorted.sum()

        # Counts (clipped) first: block q of recv_counts is what rank q sends to each of this rank's experts.
        recv_counts = _equal_all_to_all(sent_counts.reshape(-1), self.group_name, num_ranks).view(num_ranks, e_local)
        x_buf, w_buf = _EqualTokensAllToAll.apply(x_send, w_send, self.group_name, num_ranks)  # [W*C, ...]
        # Local expert of every received row: block q's rows are sorted by expert, its first sum(recv_counts[q])
        # valid; the padding after them gets the sentinel e_local, so the stable sort puts it last and keeps
        # (expert, source rank, source order) for the rest: the dropless path's order.
        expert_of_row = torch.searchsorted(recv_counts.cumsum(1), j[None, :].expand(num_ranks, cap).contiguous(),
                                           right=True).reshape(-1)  # [W*C] in [0, e_local]
        regroup = torch.argsort(expert_of_row, stable=True)
        handle = CapacityHandle(slot, kept, regroup, expert_of_row < e_local)
        return gather_rows(x_buf, regroup), w_buf.index_select(0, regroup), recv_counts.sum(0), handle

    def _combine_sync_free(self, y: torch.Tensor, handle: CapacityHandle, num_tokens: int) -> torch.Tensor:
        rows = handle.regroup.numel()
        if y.shape[0] < rows:  # the experts' per-expert loop returns the valid rows only
            y = torch.cat([y, y.new_zeros(rows - y.shape[0], y.shape[1])])
        # Back to source-rank major; padding rows (undefined after the grouped GEMM) zeroed: nothing of them
        # travels, and their gradient is zero.
        y_src = gather_rows(y, inverse_permutation(handle.regroup), handle.regroup)
        y_src = torch.where(handle.valid[:, None], y_src, 0)
        y_home = _equal_all_to_all(y_src, self.group_name, self.num_ranks)  # [W*C, D] in this rank's slot order
        y_copies = torch.where(handle.kept[:, None], y_home.index_select(0, handle.slot), 0)  # [S, D], dropped: 0
        return y_copies.view(num_tokens, -1, y.shape[1]).float().sum(1)  # LocalDispatcher's fixed-order sum


# --- applying EP to a model ----------------------------------------------------------------------------------------

def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, capacity_factor: float = 0.0) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer (DTensors, Shard(0) on ep_mesh) and install the
    all-to-all dispatcher (capacity_factor: parallel.ep_capacity_factor, 0 = dropless). A no-op when the ep mesh
    has one rank.

    Call it on the meta-built model, before to_empty and init_weights: GroupedExperts.init_weights draws every
    expert from the shared seed and keeps this rank's rows (model.common.init_normal), so each rank holds
    exactly the single process's weights for its experts. On a materialised model the rows are kept as they are.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep wants a 1-D ep mesh, got {ep_mesh.ndim} dims")
    num_ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if num_ranks == 1:
        return model
    group = ep_mesh.get_group()
    for moe in moe_layers(model):
        experts = moe.experts
        num_experts = experts.w1.shape[0]
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep size {num_ranks}")
        e_local = num_experts // num_ranks
        for name in _EXPERT_WEIGHTS:
            w = getattr(experts, name)
            rows = w.detach()[rank * e_local:(rank + 1) * e_local].clone()  # stays on meta for a meta model
            shard = DTensor.from_local(rows, ep_mesh, [Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=w.requires_grad))
        moe.dispatcher = AllToAllDispatcher(group, num_experts, capacity_factor)
    return model


def dropped_copies(model: nn.Module) -> torch.Tensor | None:
    """Token copies this rank's last forward dropped, summed over the MoE layers (0-dim int64 on the device, no
    sync; all-reduce it over ep for the job's count); None before any forward under ep."""
    counts = [m.dispatcher.dropped for m in moe_layers(model)
              if isinstance(m.dispatcher, AllToAllDispatcher) and m.dispatcher.dropped is not None]
    return torch.stack(counts).sum() if counts else None


def dropped_share(model: nn.Module, tokens: int) -> float | None:
    """The share of this rank's routed token copies (tokens x experts_per_token per MoE layer) that its last forward
    dropped, over the MoE layers with a fixed-capacity (sync-free) ep dispatcher; None without one. A dispatcher holds
    its last forward's count (a forward recomputed under activation checkpointing routes alike and writes the same
    count), so the trainer reads it once per micro-batch; the read is one host sync."""
    layers = [m for m in moe_layers(model) if isinstance(m.dispatcher, AllToAllDispatcher)
              and m.dispatcher.capacity_factor > 0 and m.dispatcher.dropped is not None]
    if not layers:
        return None
    dropped = torch.stack([m.dispatcher.dropped for m in layers]).sum()
    return float(dropped) / max(sum(tokens * m.gate.topk for m in layers), 1)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights (sharded over ep by apply_ep)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
