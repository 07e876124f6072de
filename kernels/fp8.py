"""FP8 E4M3 block quantisation (SWA window KV), the plain-PyTorch reference for REFERENCE A9 ("FP8 window KV") and
B2 (the 528 B SWA record), and the exact power-of-two scale and straight-through helpers `kernels.fp4` shares.

Contract: `quantize_fp8(x [..., D], block)` -> (values float8_e4m3fn [..., D], round-to-nearest-even of clamp(x /
scale, +-448); scales float8_e8m0fnu [..., D // block], 2^ceil(log2(max(amax, 1e-4) / 448))); `dequantize_fp8`
returns float32; `fake_quant_fp8` is their composition in x's dtype with a straight-through gradient. Everything in
fp32, the scale from the bit pattern (exact, no gradient). Every function takes impl: "reference" (here) or "triton"
(kernels.fp8_triton, bit-identical).

Design and reasoning: docs/kernels.md#fp8-formats
"""

from __future__ import annotations

import torch

from kernels.quant_common import FP8_AMAX_FLOOR, FP8_MAX, check_blocked, check_impl, check_scales

__all__ = ["quantize_fp8", "dequantize_fp8", "fake_quant_fp8"]


def pow2_ceil(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2^ceil(log2 t) for positive normal fp32 t, by the reference's exponent-field trick.

    Returns (scale as fp32, the same scale as float8_e8m0fnu). Reading the bits instead of calling
    log2/ceil keeps the result exact (no transcendental rounding at powers of two) and gradient-free.
    Non-finite t gives biased exponent 255, i.e. NaN in e8m0 and inf in fp32: bad input stays visible.
    """
    assert t.dtype == torch.float32, t.dtype
    bits = t.view(torch.int32)
    biased_exp = (bits >> 23) & 0xFF
    # A nonzero mantissa means t lies strictly above 2^(e-127): round the exponent up by one.
    biased_exp = biased_exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    biased_exp = biased_exp.clamp_max(255)
    scale_e8m0 = biased_exp.to(torch.uint8).view(torch.float8_e8m0fnu)
    scale_f32 = (biased_exp << 23).view(torch.float32)
    return scale_f32, scale_e8m0


class _StraightThrough(torch.autograd.Function):
    """Forward returns the quantised tensor; backward passes the gradient to x unchanged.

    A custom Function (rather than `x + (q - x).detach()`) keeps the forward value bit-exact: the
    add-and-subtract form can round, and turns inf inputs into NaN.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
        return quantised

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
    """Value of `quantised`, gradient of identity to `x` (deliberately beyond the reference, which has no STE)."""
    if not x.requires_grad:
        return quantised
    return _StraightThrough.apply(x, quantised.detach())


def _triton():
    """kernels.fp8_triton, imported on the first impl="triton" call."""
    from kernels import fp8_triton  # triton is an optional dependency (none off Linux): the reference runs without it

    return fp8_triton


def quantize_fp8(
    x: torch.Tensor, block: int = 32, *, impl: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8: x [..., D] any float dtype -> (values e4m3fn [..., D], scales e8m0fnu [..., NB])."""
    check_impl(impl, "quantize_fp8")
    if impl == "triton":
        return _triton().quantize_fp8(x, block)
    num_blocks = check_blocked(x, block, "quantize_fp8")
    x_blk = x.detach().float().unflatten(-1, (num_blocks, block))  # [..., NB, block]
    amax = x_blk.abs().amax(dim=-1, keepdim=True)  # [..., NB, 1]
    # fp32 reciprocal of 448, multiplied (REFERENCE A9); a division can differ in the last bit.
    inv_max = torch.full((), 1.0 / FP8_MAX, dtype=torch.float32, device=x.device)  # (filled: a CUDA graph captures it)
    scale_f32, scale_e8m0 = pow2_ceil(amax.clamp_min(FP8_AMAX_FLOOR) * inv_max)
    # scale >= amax/448, so the clamp only bites on non-finite input; the cast rounds to nearest even.
    values = (x_blk / scale_f32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.flatten(-2), scale_e8m0.squeeze(-1)


def dequantize_fp8(
    values: torch.Tensor, scales: torch.Tensor, block: int = 32, *, impl: str = "reference"
) -> torch.Tensor:
    """values e4m3fn [..., D], scales [..., NB] -> float32 [..., D]."""
    check_impl(impl, "dequantize_fp8")
    if impl == "triton":
        return _triton().dequantize_fp8(values, scales, block)
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn:
        got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise TypeError(f"dequantize_fp8: values must be torch.float8_e4m3fn, got {got}")
    num_blocks = check_blocked(values, block, "dequantize_fp8")
    check_scales(scales, values.shape[:-1], num_blocks, "dequantize_fp8")
    out = values.float().unflatten(-1, (num_blocks, block)) * scales.float().unsqueeze(-1)
    return out.flatten(-2)


def fake_quant_fp8(x: torch.Tensor, block: int = 32, *, impl: str = "reference") -> torch.Tensor:
    """dequantize_fp8(quantize_fp8(x)) in x's dtype, with a straight-through gradient to x.

    Unlike the reference, a last dim not divisible by `block` raises instead of passing x through
    unquantised: a silently skipped QAT hook is worse than a crash at start-up.
    """
    check_impl(impl, "fake_quant_fp8")
    if impl == "triton":
        return straight_through(x, _triton().fake_quant_fp8(x, block))
    values, scales = quantize_fp8(x, block, impl=impl)
    return straight_through(x, dequantize_fp8(values, scales, block, impl=impl).to(x.dtype))
