"""Small building blocks shared by the model files."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kernels.norm_rope_ref import rms_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm; statistics in fp32, output in the input dtype (kernels.norm_rope_ref.rms_norm, which the fused
    norm + RoPE kernel's reference calls too)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# Devices with an autocast mode: a tuple, not torch.amp.is_autocast_available, which torch 2.11's compiler cannot trace.
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype an autocast region computes matmuls in on `device_type`, None outside one."""
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def full_precision(device_type: str):
    """A region that autocast leaves alone (fp32 where its inputs are): the reference's fp32 computations (the
    router's logits, the compressor's pooling), which an upcast alone does not keep out of a bf16 autocast region."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter that a parallel plan distributed (a DTensor); any other tensor unchanged.

    Model code reads a parameter through this wherever it uses it outside its own module's call (an einsum, a
    functional linear), so the maths stays on plain tensors and derives per-rank sizes from the shard's shape. The
    gradient lands on the shard; plans only distribute such parameters where every rank sees the same tokens."""
    from torch.distributed.tensor import DTensor  # an isinstance test: torch.compile traces it (a getattr it does not)

    return t.to_local() if isinstance(t, DTensor) else t


def linear(in_dim: int, out_dim: int) -> nn.Linear:
    """Bias-free linear layer (the architecture has no biases)."""
    return nn.Linear(in_dim, out_dim, bias=False)


def init_normal(t: torch.Tensor, std: float) -> None:
    """normal_(t, 0, std), giving a distributed (DTensor) parameter the values the unsharded one would get: the full
    tensor is drawn from the default generator and this rank keeps its part (no communication, one transient
    full-size tensor). Every rank's generator then advances as in the single process, so a model built on meta,
    parallelised and initialised equals the single-process model (and no two ranks draw the same shard)."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        nn.init.normal_(t, mean=0.0, std=std)
        return
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        full = torch.empty(t.shape, dtype=t.dtype, device=to_local().device)
        nn.init.normal_(full, mean=0.0, std=std)
        to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())


def init_linear(module: nn.Linear, std: float) -> None:
    init_normal(module.weight, std)
