"""Triton kernels for FP4 E2M1 block quantisation, bit-exact with `kernels.fp4`.

Contract: the PyTorch references (`impl="reference"`) sit in kernels/fp4.py and kernels/fp8.py and define the
contract (formats, rounding, scale rules); every kernel here and in kernels.fp8_triton reproduces them bit for bit
for finite inputs (NaN/inf inputs are out of contract: their codes may differ). `kernels.fp4.quantize(...,
impl="triton")` and friends route here (`quantize`, `fake_quant`, `dequantize`), `kernels.fp8.quantize_fp8(...,
impl="triton")` and friends to kernels.fp8_triton. Tuning arguments (`blocks_per_prog`, `num_warps`, `variant`, a
key of VARIANTS) change the speed, not the result. The helpers shared with the other kernels live in
kernels.triton_common.

Design and reasoning: docs/kernels.md#fp4-quantisation-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_common import check_blocked, check_scales
from kernels.triton_common import (  # noqa: F401 (VARIANTS: kernels.fp4_triton.VARIANTS, as the bench sweeps it)
    DEFAULT_VARIANT,
    E4M3_RATIO_AMAX_FLOOR,
    ELEMENT_KIND,
    INV_SIX,
    PAIR_WORD,
    UE8M0_AMAX_FLOOR,
    VARIANTS,
    check_device,
    e2m1_grid,
    e2m1_mag,
    e2m1_value,
    e4m3_mag,
    e4m3_value,
    e8m0_value,
    load_blocks,
    magnitude,
    pack_pair,
    pow2_ceil,
    pow2_reciprocal,
    resolve_blocks_per_prog,
    store_bytes,
    store_scale_bytes,
    unpack_pair,
    variant_launch,
    with_sign,
    word_view,
)

__all__ = ["quantize", "dequantize", "fake_quant"]

# ------------------------------------------------------------------------------------------------------------
# FP4 E2M1


@triton.jit
def _e2m1_mag_rn(q):
    """Scaled magnitude q >= 0 -> 3-bit magnitude code (int32), equal to `e2m1_mag` in fewer instructions.
    q is clamped to 6 like the reference's v. The grid step is 0.5 below 2, 1 on [2, 4) and 2 on [4, 6];
    adding M = 2^23 * step rounds q to a multiple of the step in one correctly rounded (ties-to-even) fp32
    add, and the bits of q + M above M's count the steps; 2 * (binade - 127) adds the codes below the binade
    (0, 4 = 2.0, 6 = 4.0)."""
    q = tl.minimum(q, 6.0)
    e = tl.maximum(q.to(tl.int32, bitcast=True) >> 23, 127)  # binade of q, 127 for all q < 2
    m_bits = (e << 23) + (22 << 23)  # M = 2^(e - 105) = 2^23 * step
    return (q + m_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - m_bits + 2 * e - 254


@triton.jit
def _fp4_pair_byte(m_lo, m_hi, lo, hi):
    """Magnitude codes of channels (2i, 2i+1) and their fp32 bits -> the code byte. Each nibble gets its sign
    only where its magnitude is nonzero (m + 7 has bit 3 set exactly for m >= 1), so -0 and negatives that
    round to 0 encode as +0, like the reference."""
    mags = m_lo | (m_hi << 4)
    signs = ((lo >> 28) & 0x8) | ((hi >> 24) & 0x80)
    return mags | ((mags + 0x77) & signs)


@triton.jit
def fp4_e4m3_scale(amax):
    """Block amax (fp32, >= 0) -> (scale code int32, scale fp32, RN(1/scale) fp32) of the e4m3-scaled FP4.

    The reference divides: e4m3(min(max(amax, 6 * 2^-9) / 6, 448)); the e4m3 rounding may go down, past-6
    quotients then saturate the code. 6 has the e4m3 significand 1.5, so the three-flop quotient with
    RN(1/6) is the correctly rounded division (docs/kernels.md). The reciprocal of the scale feeds the same
    quotient per element. kernels.norm_rope_fp4 keeps its own scale code, two div_rn as in the "base" variant: the
    same result by the argument above, but not the same operations (a division against a reciprocal and two fmas)."""
    ratio = tl.minimum(_exact_quotient(tl.maximum(amax, E4M3_RATIO_AMAX_FLOOR), 6.0, INV_SIX), 448.0)
    code = e4m3_mag(ratio)
    scale = e4m3_value(code)
    return code, scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _exact_quotient(a, s, y):
    """Correctly rounded a / s from y = RN(1/s) for an e4m3 s (Markstein: see docs/kernels.md)."""
    q = a * y
    return tl.fma(tl.fma(-q, s, a), y, q)


@triton.jit
def _fp4_quant_tile(w, tile, codes_ptr, scales_ptr, fake_ptr, num_blocks,
                    BLOCK: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FAKE: tl.constexpr,
                    P: tl.constexpr, ENCODE: tl.constexpr):
    """Quantise one loaded tile of pair words w [P, BLOCK / 2] (blocks tile * P ...) and store its outputs."""
    HALF: tl.constexpr = BLOCK // 2
    lo, hi = unpack_pair(w, KIND)  # fp32 bits
    a_lo, a_hi = magnitude(lo), magnitude(hi)
    amax = tl.maximum(tl.max(a_lo, axis=1), tl.max(a_hi, axis=1))  # [P]
    if UE8M0:
        # amax floored so amax / 6 stays a normal fp32; multiply by fp32(1/6) as the reference does.
        scale, scale_code = pow2_ceil(tl.maximum(amax, UE8M0_AMAX_FLOOR) * INV_SIX)
        inv = pow2_reciprocal(scale_code)[:, None]
        q_lo, q_hi = a_lo * inv, a_hi * inv  # exact: the quotient by a power of two
    elif ENCODE == 1:
        scale_code, scale, inv = fp4_e4m3_scale(amax)
        q_lo = _exact_quotient(a_lo, scale[:, None], inv[:, None])
        q_hi = _exact_quotient(a_hi, scale[:, None], inv[:, None])
    else:  # the first kernel's two divisions, kept for comparison
        ratio = tl.minimum(tl.math.div_rn(tl.maximum(amax, E4M3_RATIO_AMAX_FLOOR), tl.zeros_like(amax) + 6.0), 448.0)
        scale_code = e4m3_mag(ratio)
        scale = e4m3_value(scale_code)
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        q_lo = _exact_quotient(a_lo, scale[:, None], inv[:, None])
        q_hi = _exact_quotient(a_hi, scale[:, None], inv[:, None])
    if ENCODE == 1:
        m_lo, m_hi = _e2m1_mag_rn(q_lo), _e2m1_mag_rn(q_hi)
    else:
        m_lo, m_hi = e2m1_mag(q_lo), e2m1_mag(q_hi)
    if FAKE:
        s = scale[:, None]
        out = pack_pair(with_sign(e2m1_grid(m_lo) * s, lo, m_lo > 0),
                        with_sign(e2m1_grid(m_hi) * s, hi, m_hi > 0), KIND)
        blk = tile.to(tl.int64) * P + tl.arange(0, P)
        offs = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
        tl.store(fake_ptr + offs, out, mask=(blk < num_blocks)[:, None])
    else:
        if ENCODE == 1:
            byte = _fp4_pair_byte(m_lo, m_hi, lo, hi)
        else:
            # The sign only on nonzero codes: -0 and negatives rounding to 0 encode as +0.
            c_lo = m_lo | tl.where(m_lo > 0, (lo >> 28) & 8, 0)
            byte = c_lo | ((m_hi | tl.where(m_hi > 0, (hi >> 28) & 8, 0)) << 4)
        store_bytes(codes_ptr, tile, byte, num_blocks, P, HALF)
        store_scale_bytes(scales_ptr, tile, scale_code, num_blocks, P)


@triton.jit
def _fp4_quant_kernel(x_ptr, codes_ptr, scales_ptr, fake_ptr, num_blocks,
                      BLOCK: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FAKE: tl.constexpr,
                      P: tl.constexpr, ENCODE: tl.constexpr, PERSISTENT: tl.constexpr):
    """x words [NB * BLOCK / 2] -> codes uint8 [NB * BLOCK / 2] + scale bits uint8 [NB], or (FAKE) the
    dequantised values as words of x's kind. One tile of P blocks per program, or (PERSISTENT) a grid-stride
    loop over tiles that loads the next tile before working on the current one (two tiles in flight)."""
    HALF: tl.constexpr = BLOCK // 2
    if PERSISTENT:
        pid, step = tl.program_id(0), tl.num_programs(0)
        w = load_blocks(x_ptr, pid, num_blocks, HALF, P)
        for i in range(0, tl.cdiv(tl.cdiv(num_blocks, P) - pid, step)):  # the grid is no larger than the tiles
            tile = pid + i * step
            w_next = load_blocks(x_ptr, tile + step, num_blocks, HALF, P)  # all masked past the end
            _fp4_quant_tile(w, tile, codes_ptr, scales_ptr, fake_ptr, num_blocks, BLOCK, KIND, UE8M0, FAKE, P, ENCODE)
            w = w_next
    else:
        tile = tl.program_id(0)
        _fp4_quant_tile(load_blocks(x_ptr, tile, num_blocks, HALF, P), tile, codes_ptr, scales_ptr, fake_ptr,
                        num_blocks, BLOCK, KIND, UE8M0, FAKE, P, ENCODE)


@triton.jit
def _fp4_dequant_kernel(codes_ptr, scales_ptr, out_ptr, num_blocks,
                        BLOCK: tl.constexpr, UE8M0: tl.constexpr, P: tl.constexpr):
    """codes uint8 [NB * BLOCK / 2] + scale bits uint8 [NB] -> fp32 pairs as int64 words [NB * BLOCK / 2]."""
    HALF: tl.constexpr = BLOCK // 2
    blk = tl.program_id(0).to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
    byte = tl.load(codes_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
    code = tl.load(scales_ptr + blk, mask=live, other=0).to(tl.int32)
    if UE8M0:
        scale = e8m0_value(code)[:, None]
    else:
        scale = e4m3_value(code)[:, None]
    out = pack_pair(e2m1_value(byte & 0xF) * scale, e2m1_value(byte >> 4) * scale, 2)
    tl.store(out_ptr + offs, out, mask=live[:, None])


def _fp4_prepare(x: torch.Tensor, block: int, scale_fmt: str, fn_name: str) -> tuple[torch.Tensor, int, int]:
    """Checks shared by quantize and fake_quant; returns (x in a supported kind, kind, number of blocks)."""
    if scale_fmt not in ("e4m3", "ue8m0"):
        raise ValueError(f"{fn_name}: scale_fmt must be 'e4m3' or 'ue8m0', got {scale_fmt!r}")
    check_blocked(x, block, fn_name, even=True)
    if block % 2 or block & (block - 1):
        raise ValueError(f"{fn_name}: the Triton kernel needs a power-of-two block, got {block}")
    check_device("x", fn_name, x)
    # Other dtypes (fp64, fp8) go through fp32 first, which is the reference's own first step.
    x = x.detach() if x.dtype in ELEMENT_KIND else x.detach().float()
    return x, ELEMENT_KIND[x.dtype], x.numel() // block


def quantize(x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *, blocks_per_prog: int | None = None,
             num_warps: int = 4, variant: str = DEFAULT_VARIANT,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP4 of x [..., D] -> (codes uint8 [..., D // 2], scales e4m3fn or e8m0fnu [..., D // block]).

    Same contract as kernels.fp4.quantize. `out`, if given, is (codes, scales) to write into (tests poison it).
    `blocks_per_prog`, `num_warps` and `variant` (a key of VARIANTS) tune the kernel, not its result.
    """
    x, kind, num_blocks = _fp4_prepare(x, block, scale_fmt, "quantize")
    ue8m0 = scale_fmt == "ue8m0"
    scale_dtype = torch.float8_e8m0fnu if ue8m0 else torch.float8_e4m3fn
    lead = x.shape[:-1]
    if out is None:
        codes = torch.empty(*lead, x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(*lead, x.shape[-1] // block, dtype=scale_dtype, device=x.device)
    else:
        codes, scales = out
        if codes.shape != (*lead, x.shape[-1] // 2) or codes.dtype != torch.uint8:
            raise ValueError(f"quantize: out codes must be uint8 {(*lead, x.shape[-1] // 2)}, got {codes.dtype} "
                             f"{tuple(codes.shape)}")
        check_scales(scales, lead, x.shape[-1] // block, "quantize")
        if scales.dtype != scale_dtype:
            raise ValueError(f"quantize: out scales must be {scale_dtype} for scale_fmt={scale_fmt!r}")
        check_device("x and out", "quantize", x, codes, scales)
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        grid, opts = variant_launch(variant, "quantize", x, triton.cdiv(num_blocks, p), num_warps)
        _fp4_quant_kernel[grid](
            word_view(x, PAIR_WORD[kind], "quantize"), codes, scales.view(torch.uint8), codes, num_blocks,
            BLOCK=block, KIND=kind, UE8M0=ue8m0, FAKE=False, P=p, num_warps=num_warps, **opts)
    return codes, scales


def fake_quant(x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *,
               blocks_per_prog: int | None = None, num_warps: int = 4, variant: str = DEFAULT_VARIANT
               ) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype in one pass (no codes in memory). No autograd: the caller
    (kernels.fp4.fake_quant) adds the straight-through gradient."""
    orig_dtype = x.dtype
    x, kind, num_blocks = _fp4_prepare(x, block, scale_fmt, "fake_quant")
    out = torch.empty_like(x)
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        words = word_view(out, PAIR_WORD[kind], "fake_quant")
        grid, opts = variant_launch(variant, "fake_quant", x, triton.cdiv(num_blocks, p), num_warps)
        _fp4_quant_kernel[grid](
            word_view(x, PAIR_WORD[kind], "fake_quant"), words, words, words, num_blocks,
            BLOCK=block, KIND=kind, UE8M0=scale_fmt == "ue8m0", FAKE=True, P=p, num_warps=num_warps, **opts)
    return out.to(orig_dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int = 16, *,
               blocks_per_prog: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes uint8 [..., D // 2], scales e4m3fn/e8m0fnu [..., D // block] -> float32 [..., D]."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"dequantize: codes must be torch.uint8, got {getattr(codes, 'dtype', type(codes))}")
    if codes.dim() == 0:
        raise ValueError("dequantize: codes must have at least one dim, got a 0-dim tensor")
    dim = 2 * codes.shape[-1]
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"dequantize: the Triton kernel needs a power-of-two block >= 2, got {block!r}")
    if dim % block:
        raise ValueError(f"dequantize: unpacked last dim {dim} is not divisible by block={block}")
    check_scales(scales, codes.shape[:-1], dim // block, "dequantize")
    if scales.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        raise TypeError(f"dequantize: scales must be float8_e4m3fn or float8_e8m0fnu, got {scales.dtype}")
    if out is None:
        out = torch.empty(*codes.shape[:-1], dim, dtype=torch.float32, device=codes.device)
    elif out.shape != (*codes.shape[:-1], dim) or out.dtype != torch.float32:
        raise ValueError(f"dequantize: out must be float32 {(*codes.shape[:-1], dim)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    check_device("codes, scales and out", "dequantize", codes, scales, out)
    num_blocks = codes.numel() * 2 // block
    p = resolve_blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp4_dequant_kernel[(triton.cdiv(num_blocks, p),)](
            codes, scales.view(torch.uint8), word_view(out, torch.int64, "dequantize"), num_blocks,
            BLOCK=block, UE8M0=scales.dtype == torch.float8_e8m0fnu, P=p)
    return out
