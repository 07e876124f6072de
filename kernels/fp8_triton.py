"""Triton kernels for FP8 E4M3 block quantisation (SWA KV), bit-exact with `kernels.fp8`:
`kernels.fp8.quantize_fp8(..., impl="triton")` and friends route here.

Contract: `quantize_fp8`, `dequantize_fp8` and `fake_quant_fp8` reproduce the reference of kernels/fp8.py bit for
bit for finite inputs (e4m3 values, one e8m0 scale per block of the last dim). They share the rounding rules, the
device helpers, the constants and the launch variants (VARIANTS, `variant=`) with kernels.fp4_triton through
kernels.triton_common. Shape legend: R rows (the leading dims flattened), D channels, NB = R * D // block blocks, P
blocks per program.

Design and reasoning: docs/kernels.md#fp8-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_common import check_blocked, check_scales
from kernels.triton_common import (
    DEFAULT_VARIANT,
    ELEMENT_KIND,
    FP8_AMAX_FLOOR,
    FP8_INV_MAX,
    FP8_MAX,
    bf16_bits,
    check_device,
    e4m3_mag,
    e4m3_value,
    e8m0_value,
    load_blocks,
    magnitude,
    pow2_ceil,
    pow2_reciprocal,
    resolve_blocks_per_prog,
    store_bytes,
    store_scale_bytes,
    variant_launch,
    with_sign,
)

__all__ = ["quantize_fp8", "dequantize_fp8", "fake_quant_fp8"]


@triton.jit
def _e4m3_mag_rn(a):
    """fp32 0 <= a <= 448 -> float8_e4m3fn bits of its magnitude, equal to `e4m3_mag` in fewer instructions:
    the step is 2^(binade - 3), 2^-9 below 2^-6 (subnormals); adding M = 2^23 * step rounds a to a multiple of
    the step (ties to even) in one fp32 add, and a mantissa carry lands in the next binade's code by itself."""
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # biased binade, 121 (2^-6) for all subnormals
    m_bits = (e << 23) + (20 << 23)  # M = 2^(e - 107) = 2^23 * 2^(e - 130)
    return (a + m_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - m_bits + 8 * e - 968


@triton.jit
def _fp8_quant_tile(x, tile, values_ptr, scales_ptr, fake_ptr, num_blocks,
                    BLOCK: tl.constexpr, KIND: tl.constexpr, FAKE: tl.constexpr, P: tl.constexpr,
                    ENCODE: tl.constexpr):
    """Quantise one loaded tile x [P, BLOCK] (blocks tile * P ...) and store its outputs."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    a = magnitude(bits)
    amax = tl.max(a, axis=1)
    # Reference: multiply by fp32(1/448), not divide; the power-of-two ceiling is read from the bits.
    scale, scale_code = pow2_ceil(tl.maximum(amax, FP8_AMAX_FLOOR) * FP8_INV_MAX)
    q = tl.minimum(a * pow2_reciprocal(scale_code)[:, None], FP8_MAX)  # exact quotient
    if ENCODE == 1:
        mag = _e4m3_mag_rn(q)
    else:
        mag = e4m3_mag(q)
    if FAKE:
        deq = with_sign(e4m3_value(mag) * scale[:, None], bits, True)
        blk = tile.to(tl.int64) * P + tl.arange(0, P)
        offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        live = (blk < num_blocks)[:, None]
        if KIND == 0:
            tl.store(fake_ptr + offs, bf16_bits(deq).to(tl.int16), mask=live)
        else:
            tl.store(fake_ptr + offs, deq.to(fake_ptr.dtype.element_ty), mask=live)
    else:
        code = mag | ((bits >> 24) & 0x80)  # the cast keeps the sign, also of values that round to 0
        store_bytes(values_ptr, tile, code, num_blocks, P, BLOCK)
        store_scale_bytes(scales_ptr, tile, scale_code, num_blocks, P)


@triton.jit
def _fp8_quant_kernel(x_ptr, values_ptr, scales_ptr, fake_ptr, num_blocks,
                      BLOCK: tl.constexpr, KIND: tl.constexpr, FAKE: tl.constexpr, P: tl.constexpr,
                      ENCODE: tl.constexpr, PERSISTENT: tl.constexpr):
    """x [NB * BLOCK] (bf16/fp16/fp32) -> e4m3 bits uint8 [NB * BLOCK] + e8m0 bits uint8 [NB], or (FAKE) the
    dequantised values (bf16 written as int16 bits, else x's dtype). Tiles and PERSISTENT as in
    kernels.fp4_triton._fp4_quant_kernel."""
    if PERSISTENT:
        pid, step = tl.program_id(0), tl.num_programs(0)
        x = load_blocks(x_ptr, pid, num_blocks, BLOCK, P)
        for i in range(0, tl.cdiv(tl.cdiv(num_blocks, P) - pid, step)):  # the grid is no larger than the tiles
            tile = pid + i * step
            x_next = load_blocks(x_ptr, tile + step, num_blocks, BLOCK, P)
            _fp8_quant_tile(x, tile, values_ptr, scales_ptr, fake_ptr, num_blocks, BLOCK, KIND, FAKE, P, ENCODE)
            x = x_next
    else:
        tile = tl.program_id(0)
        _fp8_quant_tile(load_blocks(x_ptr, tile, num_blocks, BLOCK, P), tile, values_ptr, scales_ptr, fake_ptr,
                        num_blocks, BLOCK, KIND, FAKE, P, ENCODE)


@triton.jit
def _fp8_dequant_kernel(values_ptr, scales_ptr, out_ptr, num_blocks, BLOCK: tl.constexpr, P: tl.constexpr):
    """e4m3 bits uint8 [NB * BLOCK] + e8m0 bits uint8 [NB] -> fp32 [NB * BLOCK]."""
    blk = tl.program_id(0).to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    code = tl.load(values_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
    scale = e8m0_value(tl.load(scales_ptr + blk, mask=live, other=127).to(tl.int32))
    tl.store(out_ptr + offs, e4m3_value(code) * scale[:, None], mask=live[:, None])


def _fp8_prepare(x: torch.Tensor, block: int, fn_name: str) -> tuple[torch.Tensor, int]:
    check_blocked(x, block, fn_name)
    if block & (block - 1):
        raise ValueError(f"{fn_name}: the Triton kernel needs a power-of-two block, got {block}")
    check_device("x", fn_name, x)
    x = x.detach() if x.dtype in ELEMENT_KIND else x.detach().float()
    return x, x.numel() // block


def quantize_fp8(x: torch.Tensor, block: int = 32, *, blocks_per_prog: int | None = None, num_warps: int = 4,
                 variant: str = DEFAULT_VARIANT, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of x [..., D] -> (values float8_e4m3fn [..., D], scales float8_e8m0fnu [..., D // block])."""
    x, num_blocks = _fp8_prepare(x, block, "quantize_fp8")
    lead = x.shape[:-1]
    if out is None:
        values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(*lead, x.shape[-1] // block, dtype=torch.float8_e8m0fnu, device=x.device)
    else:
        values, scales = out
        if values.shape != x.shape or values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"quantize_fp8: out values must be float8_e4m3fn {tuple(x.shape)}")
        check_scales(scales, lead, x.shape[-1] // block, "quantize_fp8")
        if scales.dtype != torch.float8_e8m0fnu:
            raise ValueError(f"quantize_fp8: out scales must be float8_e8m0fnu, got {scales.dtype}")
        check_device("x and out", "quantize_fp8", x, values, scales)
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        grid, opts = variant_launch(variant, "quantize_fp8", x, triton.cdiv(num_blocks, p), num_warps)
        _fp8_quant_kernel[grid](
            x, values.view(torch.uint8), scales.view(torch.uint8), x, num_blocks,
            BLOCK=block, KIND=ELEMENT_KIND[x.dtype], FAKE=False, P=p, num_warps=num_warps, **opts)
    return values, scales


def fake_quant_fp8(x: torch.Tensor, block: int = 32, *, blocks_per_prog: int | None = None, num_warps: int = 4,
                   variant: str = DEFAULT_VARIANT) -> torch.Tensor:
    """dequantize_fp8(quantize_fp8(x)) in x's dtype in one pass. No autograd (the caller adds the STE)."""
    orig_dtype = x.dtype
    x, num_blocks = _fp8_prepare(x, block, "fake_quant_fp8")
    out = torch.empty_like(x)
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        target = out.view(torch.int16) if x.dtype == torch.bfloat16 else out
        grid, opts = variant_launch(variant, "fake_quant_fp8", x, triton.cdiv(num_blocks, p), num_warps)
        _fp8_quant_kernel[grid](
            x, target, target, target, num_blocks, BLOCK=block, KIND=ELEMENT_KIND[x.dtype], FAKE=True, P=p,
            num_warps=num_warps, **opts)
    return out.to(orig_dtype)


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, block: int = 32, *,
                   blocks_per_prog: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """values float8_e4m3fn [..., D], scales float8_e8m0fnu [..., D // block] -> float32 [..., D]."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_fp8: values must be torch.float8_e4m3fn, got "
                        f"{getattr(values, 'dtype', type(values))}")
    check_blocked(values, block, "dequantize_fp8")
    if block & (block - 1):
        raise ValueError(f"dequantize_fp8: the Triton kernel needs a power-of-two block, got {block}")
    check_scales(scales, values.shape[:-1], values.shape[-1] // block, "dequantize_fp8")
    if scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"dequantize_fp8: the Triton kernel takes float8_e8m0fnu scales, got {scales.dtype}")
    if out is None:
        out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    elif out.shape != values.shape or out.dtype != torch.float32:
        raise ValueError(f"dequantize_fp8: out must be float32 {tuple(values.shape)}")
    check_device("values, scales and out", "dequantize_fp8", values, scales, out)
    num_blocks = values.numel() // block
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp8_dequant_kernel[(triton.cdiv(num_blocks, p),)](
            values.view(torch.uint8), scales.view(torch.uint8), out, num_blocks, BLOCK=block, P=p)
    return out
