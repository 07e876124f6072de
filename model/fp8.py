"""FP8 GEMMs in the model (`model.fp8_gemm`): a bias-free linear whose forward and input gradient run as
DeepSeek-V3's block-scaled FP8 GEMMs (kernels.fp8_gemm), and the build-time rule of which projections take them.

Contract: `Fp8Linear` is an `nn.Linear` (same parameter, same state dict, same tensor-parallel plan key) computing
y = x W^T with x quantised 1 x 128 and W 128 x 128 to float8_e4m3fn, in the compute dtype (autocast's where on).
`maybe_fp8_linear(in, out, fp8)` builds one where the switch is on and both dims are multiples of 128, else a plain
`nn.Linear` (the documented fallback: that projection stays in the compute dtype).

Design and reasoning: docs/kernels.md#fp8-training-gemms
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_gemm import fp8_linear, fp8_ok
from model.common import autocast_dtype, linear, local
from model.kernels import plain


class Fp8Linear(nn.Linear):
    """nn.Linear(bias=False) with FP8 GEMMs; impl "auto" is the Triton kernels on CUDA, the reference elsewhere."""

    def __init__(self, in_dim: int, out_dim: int, impl: str = "auto") -> None:
        super().__init__(in_dim, out_dim, bias=False)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not plain(x):  # a tensor-parallel plan hands the module DTensors: not supported yet, say so by name
            raise RuntimeError("model.fp8_gemm=true does not support tensor parallelism (parallel.tp > 1) yet")
        dtype = autocast_dtype(x.device.type) or x.dtype
        return fp8_linear(x.to(dtype), local(self.weight), impl=self.impl)


def use_fp8(fp8: bool, in_dim: int, out_dim: int) -> bool:
    """The switch, for a GEMM of these dims: on, and both dims multiples of the 128 scale block."""
    return fp8 and fp8_ok(in_dim, out_dim)


def maybe_fp8_linear(in_dim: int, out_dim: int, fp8: bool) -> nn.Linear:
    """An Fp8Linear where `use_fp8`, else the plain bias-free linear of model.common."""
    return Fp8Linear(in_dim, out_dim) if use_fp8(fp8, in_dim, out_dim) else linear(in_dim, out_dim)
