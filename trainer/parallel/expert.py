"""Expert parallelism (EP): each rank of the `ep` mesh axis holds E/ep routed experts; tokens travel to them.

Shape legend: N tokens on this rank, D model dim, K experts per token, E routed experts, W = ep ranks,
E_local = E / W experts per rank, S = N*K token copies this rank routes, R copies it receives.

Layout: rank r of the ep axis owns experts [r * E_local, (r + 1) * E_local) of every MoE layer; their w1/w3/w2
are DTensors sharded on dim 0 over the ep mesh (Shard(0)), so DCP saves each rank's rows under the usual keys
and a checkpoint loads into any other layout, the single process included.

Communication of one MoE layer, per rank, forward (the backward sends the same volumes the other way):
- split sizes: one all-to-all of E int64 counts (E_local to each rank);
- tokens: one all-to-all of the S copies, D model-dtype values each, with the fp32 routing weight packed
  bit-exactly into c extra columns of the same message (c = 2 in bf16, 1 in fp32), because the reference
  multiplies the weight in before w2, on the expert's side: S * (D + c) elements sent, R * (D + c) received;
- results: one all-to-all of the R expert outputs (D model-dtype values each) back to the tokens' ranks, where
  each token's K copies are summed in fp32 in a fixed order: R * D sent, S * D received.
So about 2 * N * K * D elements leave and arrive per rank and layer in the forward (balanced routing:
(W - 1) / W of them cross the network), and as much again in the backward. Dropless: nothing is capped or
dropped, so the split sizes go through the host (one sync per layer, in the forward; the backward reuses them).

Gradients (trainer/parallel/gradients.py `reduce_gradients`, which also holds the clip and the router-bias update):
every rank's loss is the mean over its own tokens, and the job's loss is the mean over the ranks that read
different tokens (dp x ep x cp). A non-expert gradient is therefore averaged over those ranks. An expert's local
gradient already holds the contributions of every ep peer whose tokens it served (they came back through the
all-to-all), so it is summed over its replicas only (dp, and cp) and divided by the same dp x ep x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from model.moe import GroupedExperts, LocalDispatcher, MoE

_EXPERT_WEIGHTS = ("w1", "w3", "w2")


# --- autograd-aware all-to-alls ------------------------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _pack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [S, D], w [S] fp32 -> [S, D + c]: w's bytes appended as c columns of x's dtype (exact, no rounding)."""
    if 4 % x.element_size() == 0:
        cols = w.float().contiguous()[:, None].view(x.dtype)  # [S, 4 / itemsize]
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


# --- the dispatcher ------------------------------------------------------------------------------------------------

@dataclass
class EPHandle:
    """What combine needs to bring expert outputs home."""

    order: torch.Tensor  # [S] the local sort of this rank's copies by global expert (LocalDispatcher's handle)
    send_splits: list[int]  # [W] copies this rank sent to each rank
    recv_splits: list[int]  # [W] copies this rank received from each rank
    regroup: torch.Tensor  # [R] received rows (source-rank major) -> local-expert-major order


class AllToAllDispatcher:
    """Dropless all-to-all dispatch with LocalDispatcher's interface (model/moe.py).

    dispatch(x [N, D], topk_idx [N, K] global ids, topk_weights [N, K]) ->
      (x_recv [R, D], weights_recv [R], tokens_per_expert [E_local] int64, EPHandle);
    combine(y [R, D], handle, N) -> [N, D] fp32.
    Received rows are ordered by local expert, then source rank, then the source's token order: the same rows
    in the same order as LocalDispatcher gives those experts when one process holds every rank's tokens
    (concatenated in ep-rank order), so the expert GEMMs see identical inputs.
    """

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep size {self.num_ranks}")
        self.num_experts = num_experts
        self.num_local = num_experts // self.num_ranks
        self.local = LocalDispatcher(num_experts)  # the sort by global expert is also the sort by owning rank

    def dispatch(
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
        return x_recv.index_select(0, regroup), w_recv.index_select(0, regroup), recv_counts.sum(0), handle

    def combine(self, y: torch.Tensor, handle: EPHandle, num_tokens: int) -> torch.Tensor:
        inverse = torch.empty_like(handle.regroup)
        inverse[handle.regroup] = torch.arange(handle.regroup.numel(), device=y.device)
        y_src = y.index_select(0, inverse)  # [R] back to source-rank major
        y_home = _AllToAll.apply(y_src, handle.send_splits, handle.recv_splits, self.group)  # [S, D]
        return self.local.combine(y_home, handle.order, num_tokens)  # fp32 sum of the K copies, fixed order


# --- applying EP to a model ----------------------------------------------------------------------------------------

def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer (DTensors, Shard(0) on ep_mesh) and install the
    all-to-all dispatcher. A no-op when the ep mesh has one rank.

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
        moe.dispatcher = AllToAllDispatcher(group, num_experts)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights (sharded over ep by apply_ep)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
