"""Context parallelism (CP): the cp ranks of one data group split every sequence of the batch into cp chunks.

Contract: rank r of the cp axis holds positions [r * T_c, (r + 1) * T_c) of every row (T_c = T / cp; contiguous
chunks aligned with compressor groups, T_c >= SWA window - 1: `check_sequence_length`). Every cp rank reads the same
batch and keeps its chunk of ids, labels and image mask (`shard_sequence`). `apply_cp` installs plain callables in
the model's `SequenceShard` (and each MoE's `chunk_mean`); parameters are not touched, so FSDP/TP/EP compose as
usual. Each query row, its top-k and its pool equal the single process's; the mean over cp ranks of a rank's aux
loss equals the single process's. The trainer averages each rank's per-token LM loss over cp, averages replicated
gradients over dp x ep x cp and sums MoE load counts over dp x ep x cp (trainer/parallel/gradients.py).

Design and reasoning: docs/parallelism.md#context-parallelism
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from model.forward import SequenceShard
from model.config import ModelConfig

__all__ = ["apply_cp", "check_sequence_length", "sequence_shard", "shard_sequence"]


# --- validation and the batch ---------------------------------------------------------------------------------------

def check_sequence_length(cfg: ModelConfig, seq_len: int, cp: int) -> None:
    """ValueError unless sequences of `seq_len` tokens split into cp chunks that align with every compressor group and
    each hold a whole window halo."""
    if cp == 1:
        return
    if seq_len % cp:
        raise ValueError(f"context parallelism: sequence length {seq_len} is not divisible by cp={cp}")
    chunk = seq_len // cp
    for ratio in sorted({r for r in cfg.csa2.compress_ratios if r > 0}):
        if chunk % ratio:
            raise ValueError(
                f"context parallelism: chunk length {chunk} (sequence length {seq_len} / cp={cp}) is not divisible by "
                f"the compression ratio {ratio} (model.csa2.compress_ratios): a compressor group would straddle chunks")
    halo = cfg.attention.window - 1
    if chunk < halo:
        raise ValueError(
            f"context parallelism: chunk length {chunk} (sequence length {seq_len} / cp={cp}) is shorter than the "
            f"window halo of {halo} rows (model.attention.window={cfg.attention.window} - 1): the previous chunk "
            "alone must hold it")


def shard_sequence(t: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of `t` along `dim` (ids, labels, image mask: [B, T] -> [B, T / cp]). Every cp rank
    holds the same batch, so no communication."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if t.shape[dim] % cp:
        raise ValueError(f"context parallelism: sequence length {t.shape[dim]} is not divisible by cp={cp}")
    return t.chunk(cp, dim=dim)[rank]


# --- the exchanges --------------------------------------------------------------------------------------------------

# torch 2.13 names the flat collectives all_gather_single / reduce_scatter_single; 2.11 (the GPU machine) has only
# their older names, which 2.13 keeps as aliases.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class _GatherChunks(torch.autograd.Function):
    """[B, n, C] on each rank -> [B, cp * n, C], chunks in rank order; the backward reduce-scatters (sums) the
    gradient back to the chunk's owner."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))  # [cp * B, n, C]: gloo wants the concatenated form
        _all_gather_flat(out, x.contiguous(), group=group)
        return out.unflatten(0, (cp, -1)).transpose(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        parts = grad.unflatten(1, (cp, -1)).transpose(0, 1)  # [cp, B, n, C]
        out = parts.new_empty(parts.shape[1:])
        _reduce_scatter_flat(out, parts.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def _gather_entries(group: dist.ProcessGroup, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(t [B, E_c, C_i], ...) -> (t [B, E, C_i], ...): one message for tensors of one dtype (main latent + keys)."""
    if len({t.dtype for t in tensors}) > 1:
        return tuple(_GatherChunks.apply(t, group) for t in tensors)
    widths = [t.shape[-1] for t in tensors]
    return _GatherChunks.apply(torch.cat(tensors, dim=-1), group).split(widths, dim=-1)


def _exchange(send: torch.Tensor | None, send_to: int | None, recv: torch.Tensor | None, recv_from: int | None,
              group: dist.ProcessGroup) -> None:
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=send_to))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=recv_from))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _WindowHalo(torch.autograd.Function):
    """kv [B, T_c, D] -> [B, rows + T_c, D]: the previous rank's last `rows` rows in front (zeros on rank 0). The
    backward sends the halo's gradient back to the previous rank, which adds it to its last rows."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ctx.rows, ctx.group, ctx.rank, ctx.cp = rows, group, rank, cp
        halo = kv.new_zeros((kv.shape[0], rows, *kv.shape[2:]))
        tail = kv[:, kv.shape[1] - rows:].contiguous()
        has_next, has_prev = rank + 1 < cp, rank > 0
        _exchange(tail if has_next else None, rank + 1, halo if has_prev else None, rank - 1, group)
        return torch.cat((halo, kv), dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, rank, cp = ctx.rows, ctx.rank, ctx.cp
        has_next, has_prev = rank + 1 < cp, rank > 0
        grad_kv = grad[:, rows:].clone()
        from_next = grad.new_empty((grad.shape[0], rows, *grad.shape[2:])) if has_next else None
        _exchange(grad[:, :rows].contiguous() if has_prev else None, rank - 1, from_next, rank + 1, ctx.group)
        if from_next is not None:
            grad_kv[:, grad_kv.shape[1] - rows:] += from_next
        return grad_kv, None, None


def _window_halo(group: dist.ProcessGroup, rows: int, kv: torch.Tensor) -> torch.Tensor:
    return _WindowHalo.apply(kv, rows, group) if rows > 0 else kv


@torch.no_grad()
def _gather_tokens(group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """[B, T_c] -> [B, T] (ids, masks), no gradient."""
    send = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool collectives
    cp = dist.get_world_size(group)
    out = send.new_empty((cp * send.shape[0], *send.shape[1:]))
    _all_gather_flat(out, send.contiguous(), group=group)
    out = out.unflatten(0, (cp, -1)).transpose(0, 1).flatten(1, 2)
    return out.bool() if t.dtype == torch.bool else out


@torch.no_grad()
def _chunk_mean(group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    dist.all_reduce(out, group=group)  # SUM: gloo has no AVG
    return out / dist.get_world_size(group)


# --- the plan -------------------------------------------------------------------------------------------------------

def sequence_shard(cp_mesh: DeviceMesh, window: int) -> SequenceShard:
    """The model's SequenceShard for this rank of `cp_mesh`, its hooks bound to the cp process group."""
    group = cp_mesh.get_group()
    return SequenceShard(
        index=cp_mesh.get_local_rank(),
        gather_entries=functools.partial(_gather_entries, group),
        window_halo=functools.partial(_window_halo, group, window - 1),
        gather_tokens=functools.partial(_gather_tokens, group),
        chunk_mean=functools.partial(_chunk_mean, group),
    )


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Context parallelism for a `model.transformer.Transformer`, in place: install the cp hooks and a check of the
    chunk length. Touches no parameter, so it composes with the other plans in any order, on meta or materialised
    models. Afterwards feed the model this rank's chunk of every sequence (`shard_sequence`). No-op for cp = 1."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp wants a 1-D cp mesh, got {cp_mesh.ndim} dims")
    cp = cp_mesh.size()
    if cp == 1:
        return model
    cfg = model.cfg
    shard = sequence_shard(cp_mesh, cfg.attention.window)
    model.sequence_shard = shard
    for moe in model.moe_layers():
        moe.chunk_mean = shard.chunk_mean

    def check_chunk(_, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        check_sequence_length(cfg, ids.shape[1] * cp, cp)

    model.register_forward_pre_hook(check_chunk, with_kwargs=True)
    return model
