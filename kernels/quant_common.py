"""What the block quantisers of kernels/ share, references and Triton kernels alike: the FP8 E4M3 constants and
the input checks (implementation name, blocked tensor, scales).

A leaf: it imports nothing of the project, so kernels.fp8 / kernels.fp4 (the references) and their Triton kernels
(kernels.fp8_triton, kernels.fp4_triton, kernels.triton_common) all import it without a loop between them.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""largest finite float8_e4m3fn magnitude"""
FP8_AMAX_FLOOR = 1e-4
"""REFERENCE A9: the block amax is floored here so an all-zero block still gets a finite scale"""

IMPLS = ("reference", "triton")


def check_impl(impl: str, fn_name: str) -> None:
    """Reject unknown implementations. `triton` routes to kernels.fp4_triton / kernels.fp8_triton (CUDA, or the CPU
    interpreter)."""
    if impl not in IMPLS:
        raise ValueError(f"{fn_name}: impl must be one of {list(IMPLS)}, got {impl!r}")


def check_blocked(x: torch.Tensor, block: int, fn_name: str, *, even: bool = False) -> int:
    """Validate a float tensor quantised in blocks along its last dim; return the number of blocks."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn_name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{fn_name}: expected a floating-point tensor, got dtype {x.dtype}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{fn_name}: block must be a positive int, got {block!r}")
    if x.dim() == 0:
        raise ValueError(f"{fn_name}: expected at least one dim (channels last), got a 0-dim tensor")
    dim = x.shape[-1]
    if even and dim % 2 != 0:
        raise ValueError(f"{fn_name}: last dim must be even to pack two FP4 codes per byte, got {dim}")
    if dim % block != 0:
        raise ValueError(f"{fn_name}: last dim {dim} is not divisible by block={block}")
    return dim // block


def check_scales(scales: torch.Tensor, lead: torch.Size, num_blocks: int, fn_name: str) -> None:
    """Scales must be one per block, with the same leading dims as the values they scale."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{fn_name}: scales must be a torch.Tensor, got {type(scales).__name__}")
    if not scales.is_floating_point():
        raise TypeError(f"{fn_name}: scales must be a float tensor (float8_e4m3fn/e8m0fnu), got {scales.dtype}")
    want = (*lead, num_blocks)
    if tuple(scales.shape) != want:
        raise ValueError(f"{fn_name}: scales shape {tuple(scales.shape)} does not match expected {want}")
