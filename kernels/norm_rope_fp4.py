"""Fused RMSNorm + RoPE + block (fake-)quantisation of KV-style rows, forward and backward (issue #5, kernel 1).

Contract: `norm_rope_fake_quant` computes fake_quant(apply_rope(rms_norm(x, weight, eps), cos, sin)) in one pass per
row, differentiable in x and weight (straight-through at the quantiser); `norm_rope_quantize` writes the inference
cache record instead (codes + scales, the kernels.fp4.quantize / kernels.fp8.quantize_fp8 contract; no gradient).
Both can also return y, the pre-RoPE normed row (detached). `impl="reference"` is the composition of the model's own
functions, `impl="triton"` the kernels here; both take the norm as its weight and eps (no module), weight None for
no norm. `quant` (`QUANTS`): "fp4" (E2M1, e4m3 scale per 16: main KV), "fp4_ue8m0" (E2M1, ue8m0 scale per 32:
indexer keys and queries), "fp8" (E4M3, ue8m0 scale per 32: SWA KV), None (norm + RoPE only). Every rounding the
reference makes is made at the same place, on the bits, except the order of the sum of squares: rstd can move by
an ulp and, rarely, y by one rounding of x's dtype.

Design and reasoning: docs/kernels.md#fused-norm-rope-and-quantisation
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp4, fp8
from kernels.norm_rope_ref import apply_rope, rms_norm
from kernels.triton_common import (
    E4M3_RATIO_AMAX_FLOOR,
    ELEMENT_KIND,
    FP8_AMAX_FLOOR,
    FP8_INV_MAX,
    FP8_MAX,
    INV_SIX,
    PAIR_WORD,
    UE8M0_AMAX_FLOOR,
    bf16_round,
    check_device,
    e2m1_grid,
    e4m3_mag,
    e4m3_value,
    fp4_code,
    interpreting,
    magnitude,
    pack_pair,
    pow2_ceil,
    pow2_reciprocal,
    unpack_pair,
    with_sign,
    word_view,
)

__all__ = ["norm_rope_fake_quant", "norm_rope_quantize", "QUANTS"]

QUANTS = {None: None, "fp4": (16, "e4m3"), "fp4_ue8m0": (32, "ue8m0"), "fp8": (32, "ue8m0")}
"""quant -> (block, scale format) of the quantiser, None for none"""
_QUANT_ID = {None: 0, "fp4": 1, "fp4_ue8m0": 2, "fp8": 3}
_IMPLS = ("reference", "triton")


# ------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _round(v, KIND: tl.constexpr):
    """fp32 -> fp32 holding v rounded to nearest even in the element kind (what a store and reload gives)."""
    if KIND == 0:
        return bf16_round(v)
    elif KIND == 1:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Elements of kind KIND -> fp32; bf16 comes as int16 bits (the interpreter's bf16 conversions are unreliable)."""
    if KIND == 0:
        return (tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _load_pairs(ptr, offs, mask, KIND: tl.constexpr):
    """Pair words -> (even, odd) channels as fp32."""
    lo, hi = unpack_pair(tl.load(ptr + offs, mask=mask, other=0), KIND)
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _tile(tile, num_rows, seq_len, num_heads, HALF: tl.constexpr, HALF_R: tl.constexpr, NB_P: tl.constexpr,
          HB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row tile `tile` -> (rows [BR], pair offsets [BR, NB_P, HB], their mask, RoPE table offsets, RoPE mask)."""
    row = tl.arange(0, BLOCK_R).to(tl.int64) + tile * BLOCK_R  # int64: row * DP may pass 2^31
    pair = tl.arange(0, NB_P)[:, None] * HB + tl.arange(0, HB)[None, :]  # [NB_P, HB] pair index in the row
    if NB_P * HB == HALF:  # no padded blocks: a mask constant along the row lets the loads vectorise
        live = (row < num_rows)[:, None, None] & tl.full([1, NB_P, HB], 1, tl.int1)
    else:
        live = (row < num_rows)[:, None, None] & (pair < HALF)[None, :, :]
    offs = row[:, None, None] * HALF + pair[None, :, :]
    # RoPE: the last HALF_R pairs; row (b, t, h) reads the tables' row t
    NOPE: tl.constexpr = HALF - HALF_R
    t = (row // num_heads) % seq_len
    rope = live & (pair >= NOPE)[None, :, :]
    cs_offs = t[:, None, None] * HALF_R + (pair - NOPE)[None, :, :]
    return row, offs, live, cs_offs, rope


@triton.jit
def _norm_rope_quant_fwd(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, scales_ptr, normed_ptr, rstd_ptr,
                         num_rows, seq_len, num_heads, eps,
                         D: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, HB: tl.constexpr,
                         HALF_R: tl.constexpr, KIND: tl.constexpr, W_KIND: tl.constexpr, CS_KIND: tl.constexpr,
                         NORM: tl.constexpr, QUANT: tl.constexpr, FAKE: tl.constexpr, NORMED: tl.constexpr,
                         RSTD: tl.constexpr, BLOCK_R: tl.constexpr):
    """x pair words [R, DP] -> out: (FAKE or QUANT == 0) the (fake-quantised) rows as words of x's kind, else the
    record (FP4 codes uint8 [R, DP] / FP8 e4m3 byte pairs int16 [R, DP]) + scale bytes uint8 [R, NB];
    optionally normed (words of x's kind, pre-RoPE y) and rstd fp32 [R]."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    eps = tl.cast(eps, tl.float32)
    HALF: tl.constexpr = D // 2
    row, offs, live, cs_offs, rope = _tile(tl.program_id(0), num_rows, seq_len, num_heads, HALF, HALF_R, NB_P, HB,
                                           BLOCK_R)
    lo, hi = _load_pairs(x_ptr, offs, live, KIND)  # [BR, NB_P, HB] fp32, exact
    if NORM:
        # torch: x.pow(2).mean(-1) (a sum, then / D), + eps, rsqrt; then (x * rstd) * w, rounded to x's dtype
        ss = tl.sum(tl.sum(lo * lo + hi * hi, axis=2), axis=1)  # [BR]
        rstd = tl.math.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + D) + eps)
        pair = tl.arange(0, NB_P)[:, None] * HB + tl.arange(0, HB)[None, :]
        w_lo, w_hi = _load_pairs(w_ptr, pair, pair < HALF, W_KIND)  # [NB_P, HB]
        r = rstd[:, None, None]
        y_lo = _round(lo * r * w_lo[None, :, :], KIND)
        y_hi = _round(hi * r * w_hi[None, :, :], KIND)
        if RSTD:
            tl.store(rstd_ptr + row, rstd, mask=row < num_rows)
    else:
        y_lo, y_hi = lo, hi
    if NORMED:
        tl.store(normed_ptr + offs, pack_pair(y_lo, y_hi, KIND), mask=live)
    # RoPE on the rounded y with the tables' values, then rounded again (apply_rope's .float() / .to(x.dtype))
    c = _load_f32(cos_ptr, cs_offs, rope, CS_KIND)
    s = _load_f32(sin_ptr, cs_offs, rope, CS_KIND)
    v_lo = tl.where(rope, _round(y_lo * c - y_hi * s, KIND), y_lo)
    v_hi = tl.where(rope, _round(y_lo * s + y_hi * c, KIND), y_hi)
    if QUANT == 0:
        tl.store(out_ptr + offs, pack_pair(v_lo, v_hi, KIND), mask=live)
    else:
        b_lo, b_hi = v_lo.to(tl.int32, bitcast=True), v_hi.to(tl.int32, bitcast=True)
        a_lo, a_hi = magnitude(b_lo), magnitude(b_hi)
        amax = tl.max(tl.maximum(a_lo, a_hi), axis=2)  # [BR, NB_P]
        if QUANT == 3:  # FP8: scale = pow2ceil(max(amax, 1e-4) * fp32(1 / 448)), an exact quotient
            scale, scale_code = pow2_ceil(tl.maximum(amax, FP8_AMAX_FLOOR) * FP8_INV_MAX)
            inv = pow2_reciprocal(scale_code)[:, :, None]
            m_lo = e4m3_mag(tl.minimum(a_lo * inv, FP8_MAX))
            m_hi = e4m3_mag(tl.minimum(a_hi * inv, FP8_MAX))
            if FAKE:
                sc = scale[:, :, None]
                o_lo = with_sign(e4m3_value(m_lo) * sc, b_lo, True)  # the cast keeps the sign, also of 0
                o_hi = with_sign(e4m3_value(m_hi) * sc, b_hi, True)
                tl.store(out_ptr + offs, pack_pair(o_lo, o_hi, KIND), mask=live)
            else:
                code = (m_lo | ((b_lo >> 24) & 0x80)) | ((m_hi | ((b_hi >> 24) & 0x80)) << 8)
                tl.store(out_ptr + offs, code.to(tl.int16), mask=live)
        else:
            if QUANT == 2:  # ue8m0: amax floored so amax / 6 stays normal; multiply by fp32(1/6), as the reference
                scale, scale_code = pow2_ceil(tl.maximum(amax, UE8M0_AMAX_FLOOR) * INV_SIX)
                inv = pow2_reciprocal(scale_code)[:, :, None]
                q_lo, q_hi = a_lo * inv, a_hi * inv
            else:  # e4m3: a true division, rounded to e4m3 (may round down: the code then saturates at 6)
                ratio = tl.minimum(tl.math.div_rn(tl.maximum(amax, E4M3_RATIO_AMAX_FLOOR),
                                                  tl.zeros_like(amax) + 6.0), 448.0)
                scale_code = e4m3_mag(ratio)
                scale = e4m3_value(scale_code)
                sc = scale[:, :, None]
                inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)[:, :, None]  # then one fma correction
                q_lo, q_hi = a_lo * inv, a_hi * inv
                q_lo = tl.fma(tl.fma(-q_lo, sc, a_lo), inv, q_lo)
                q_hi = tl.fma(tl.fma(-q_hi, sc, a_hi), inv, q_hi)
            c_lo, m_lo = fp4_code(b_lo, q_lo)
            c_hi, m_hi = fp4_code(b_hi, q_hi)
            if FAKE:
                sc = scale[:, :, None]
                o_lo = with_sign(e2m1_grid(m_lo) * sc, b_lo, m_lo > 0)
                o_hi = with_sign(e2m1_grid(m_hi) * sc, b_hi, m_hi > 0)
                tl.store(out_ptr + offs, pack_pair(o_lo, o_hi, KIND), mask=live)
            else:
                tl.store(out_ptr + offs, (c_lo | (c_hi << 4)).to(tl.uint8), mask=live)
        if not FAKE:
            blk = tl.arange(0, NB_P)
            s_live = (row < num_rows)[:, None] & (blk < NB)[None, :]
            tl.store(scales_ptr + row[:, None] * NB + blk[None, :], scale_code.to(tl.uint8), mask=s_live)


@triton.jit
def _norm_rope_bwd(g_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, dw_ptr,
                   num_rows, seq_len, num_heads, num_tiles,
                   D: tl.constexpr, NB_P: tl.constexpr, HB: tl.constexpr, HALF_R: tl.constexpr,
                   KIND: tl.constexpr, W_KIND: tl.constexpr, CS_KIND: tl.constexpr, NORM: tl.constexpr,
                   DW: tl.constexpr, BLOCK_R: tl.constexpr):
    """dq pair words [R, DP] (x's kind) -> dx pair words [R, DP]; with DW, this program's dw partial as fp32 pair
    words [programs, DP]. Row tiles pid, pid + programs, ..."""
    HALF: tl.constexpr = D // 2
    pid = tl.program_id(0)
    pair = tl.arange(0, NB_P)[:, None] * HB + tl.arange(0, HB)[None, :]
    if NORM:
        w_lo, w_hi = _load_pairs(w_ptr, pair, pair < HALF, W_KIND)
        w_lo, w_hi = w_lo[None, :, :], w_hi[None, :, :]
    acc_lo = tl.zeros([NB_P, HB], dtype=tl.float32)
    acc_hi = tl.zeros([NB_P, HB], dtype=tl.float32)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        row, offs, live, cs_offs, rope = _tile(tile, num_rows, seq_len, num_heads, HALF, HALF_R, NB_P, HB, BLOCK_R)
        g_lo, g_hi = _load_pairs(g_ptr, offs, live, KIND)  # the straight-through gradient of the quantiser
        # RoPE's transpose; the reference's `.float()` of y's tail rounds this gradient to x's dtype
        c = _load_f32(cos_ptr, cs_offs, rope, CS_KIND)
        s = _load_f32(sin_ptr, cs_offs, rope, CS_KIND)
        dy_lo = tl.where(rope, _round(g_lo * c + g_hi * s, KIND), g_lo)
        dy_hi = tl.where(rope, _round(g_hi * c - g_lo * s, KIND), g_hi)
        if NORM:
            x_lo, x_hi = _load_pairs(x_ptr, offs, live, KIND)
            rstd = tl.load(rstd_ptr + row, mask=row < num_rows, other=0.0)
            r = rstd[:, None, None]
            gn_lo, gn_hi = dy_lo * w_lo, dy_hi * w_hi  # gradient of x * rstd
            dot = tl.sum(tl.sum(gn_lo * x_lo + gn_hi * x_hi, axis=2), axis=1)  # gradient of rstd, / x
            # rsqrt' = -rstd^3 / 2, the mean's 1 / D and the square's 2x (the reference's autograd chain)
            coef = tl.math.div_rn(-0.5 * dot * (rstd * rstd * rstd), tl.zeros_like(dot) + D)[:, None, None]
            dx_lo = gn_lo * r + coef * (2.0 * x_lo)
            dx_hi = gn_hi * r + coef * (2.0 * x_hi)
            if DW:
                acc_lo += tl.sum(dy_lo * (x_lo * r), axis=0)
                acc_hi += tl.sum(dy_hi * (x_hi * r), axis=0)
        else:
            dx_lo, dx_hi = dy_lo, dy_hi
        tl.store(dx_ptr + offs, pack_pair(dx_lo, dx_hi, KIND), mask=live)
    if DW:
        tl.store(dw_ptr + pid.to(tl.int64) * HALF + pair, pack_pair(acc_lo, acc_hi, 2), mask=pair < HALF)


# ------------------------------------------------------------------------------------------------------------
# Host side


def _rows_per_prog(dim: int, rows_per_prog: int | None) -> int:
    # ~2048 channels per program (4 rows of 512, 16 of 128), the size the fp4_triton kernels found flat on the H200;
    # bench/kernel_cases/norm_rope_fp4.py sweeps it. A power of two (a tile axis).
    if rows_per_prog is None:
        return 1 << max(0, (2048 // dim).bit_length() - 1)
    if rows_per_prog < 1 or rows_per_prog & (rows_per_prog - 1):
        raise ValueError(f"norm_rope: rows_per_prog must be a power of two, got {rows_per_prog}")
    return rows_per_prog


def _layout(dim: int, quant: str | None) -> tuple[int, int, int]:
    """(NB, NB_P, HB): quantisation blocks per row, padded to a power of two, and pairs per block. Without a
    quantiser the row is tiled in blocks of 16 channels (any even D works; the blocks only shape the tile)."""
    block = QUANTS[quant][0] if quant is not None else (16 if dim % 16 == 0 else 2)
    nb = dim // block
    return nb, triton.next_power_of_2(nb), block // 2


def _launch_opts() -> dict:
    # No fma contraction: the reference rounds every product and sum of RoPE and the norm on its own.
    return {} if interpreting() else {"enable_fp_fusion": False}


def _check(x, weight, eps, cos, sin, quant, fn_name) -> None:
    """Checks of the public functions."""
    if quant not in QUANTS:
        raise ValueError(f"{fn_name}: quant must be one of {list(QUANTS)}, got {quant!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in ELEMENT_KIND:
        raise TypeError(f"{fn_name}: x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() not in (3, 4):
        raise ValueError(f"{fn_name}: x must be [B, T, D] or [B, T, H, D], got shape {tuple(x.shape)}")
    dim = x.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[1]:
        raise ValueError(f"{fn_name}: cos and sin must both be [T, RD / 2] with T = {x.shape[1]}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != sin.dtype or cos.dtype not in ELEMENT_KIND:
        raise TypeError(f"{fn_name}: cos and sin must share a bf16/fp16/fp32 dtype, got {cos.dtype}, {sin.dtype}")
    if not 0 < 2 * cos.shape[1] <= dim:
        raise ValueError(f"{fn_name}: RoPE dims 2 * {cos.shape[1]} must be in [2, D = {dim}]")
    block = QUANTS[quant][0] if quant is not None else 2
    if dim % block:
        raise ValueError(f"{fn_name}: D = {dim} must be divisible by the {quant or 'pair'} block of {block}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.shape != (dim,) or weight.dtype not in ELEMENT_KIND:
            raise ValueError(f"{fn_name}: the norm's weight must be [D = {dim}] bf16/fp16/fp32, got "
                             f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{fn_name}: a norm's weight needs its eps as a float, got {eps!r}")


def _cs_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _forward(x, weight, cos, sin, eps, quant, *, fake, normed, rstd, rows_per_prog=None, num_warps=4):
    """Launch the forward kernel. Returns (out, scales or None, normed or None, rstd or None)."""
    weights = [] if weight is None else [weight]
    check_device("x, the norm's weight, cos and sin", "norm_rope", x, *weights, cos, sin)
    dim, heads = x.shape[-1], (x.shape[2] if x.dim() == 4 else 1)
    num_rows = x.numel() // dim
    nb, nb_p, hb = _layout(dim, quant)
    kind = ELEMENT_KIND[x.dtype]
    word = PAIR_WORD[kind]
    lead = x.shape[:-1]
    scales = None
    if fake or quant is None:
        out = torch.empty_like(x)
        out_words = word_view(out, word, "norm_rope")
    elif quant == "fp8":
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        out_words = out.view(torch.int16)
    else:
        out = torch.empty(*lead, dim // 2, dtype=torch.uint8, device=x.device)
        out_words = out
    if quant is not None and not fake:
        scale_dtype = torch.float8_e4m3fn if quant == "fp4" else torch.float8_e8m0fnu
        scales = torch.empty(*lead, nb, dtype=scale_dtype, device=x.device)
    y = torch.empty_like(x) if normed else None
    r = torch.empty(num_rows, dtype=torch.float32, device=x.device) if rstd and weight is not None else None
    x_words = word_view(x, word, "norm_rope")
    w_words = x_words if weight is None else word_view(weight, PAIR_WORD[ELEMENT_KIND[weight.dtype]], "norm_rope")
    y_words = x_words if y is None else word_view(y, word, "norm_rope")
    bpp = _rows_per_prog(dim, rows_per_prog)
    if num_rows:
        _norm_rope_quant_fwd[(triton.cdiv(num_rows, bpp),)](
            x_words, w_words, _cs_view(cos), _cs_view(sin), out_words,
            x_words if scales is None else scales.view(torch.uint8), y_words, x_words if r is None else r,
            num_rows, x.shape[1], heads, float(eps),
            D=dim, NB=nb, NB_P=nb_p, HB=hb, HALF_R=cos.shape[1], KIND=kind,
            W_KIND=ELEMENT_KIND[weight.dtype] if weight is not None else kind, CS_KIND=ELEMENT_KIND[cos.dtype],
            NORM=weight is not None, QUANT=_QUANT_ID[quant], FAKE=fake, NORMED=normed, RSTD=r is not None,
            BLOCK_R=bpp, num_warps=num_warps, **_launch_opts())
    return out, scales, y, r


def _max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter runs programs one after another: few programs, long loops


def _backward(g, x, weight, rstd, cos, sin, *, need_dw, rows_per_prog=None, num_warps=4, max_programs=None):
    """Launch the backward kernel: (dx in x's dtype, dw in the weight's dtype or None)."""
    dim, heads = x.shape[-1], (x.shape[2] if x.dim() == 4 else 1)
    num_rows = x.numel() // dim
    _, nb_p, hb = _layout(dim, None)  # the backward has no blocks: the plain pair tile
    kind = ELEMENT_KIND[x.dtype]
    word = PAIR_WORD[kind]
    bpp = _rows_per_prog(dim, rows_per_prog)
    num_tiles = triton.cdiv(num_rows, bpp)
    grid = max(1, min(num_tiles, max_programs or _max_programs(x.device)))
    dx = torch.empty_like(x)
    norm = weight is not None
    dw_part = torch.empty(grid, dim, dtype=torch.float32, device=x.device) if norm and need_dw else None
    x_words = word_view(x, word, "norm_rope backward")
    if num_rows:
        _norm_rope_bwd[(grid,)](
            word_view(g, word, "norm_rope backward"), x_words,
            word_view(weight, PAIR_WORD[ELEMENT_KIND[weight.dtype]], "norm_rope backward") if norm else x_words,
            _cs_view(cos), _cs_view(sin), rstd if norm else x_words, word_view(dx, word, "norm_rope backward"),
            x_words if dw_part is None else dw_part.view(torch.int64),
            num_rows, x.shape[1], heads, num_tiles,
            D=dim, NB_P=nb_p, HB=hb, HALF_R=cos.shape[1], KIND=kind,
            W_KIND=ELEMENT_KIND[weight.dtype] if norm else kind, CS_KIND=ELEMENT_KIND[cos.dtype], NORM=norm,
            DW=dw_part is not None, BLOCK_R=bpp, num_warps=num_warps, **_launch_opts())
    elif dw_part is not None:
        dw_part.zero_()
    dw = None if dw_part is None else dw_part.sum(0).to(weight.dtype)
    return dx, dw


class _NormRopeFakeQuant(torch.autograd.Function):
    """Forward: the fused kernel. Backward: straight-through quantiser, RoPE's transpose, RMSNorm's backward."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps, quant, want_normed, rows_per_prog):
        needs_grad = x.requires_grad or (weight is not None and weight.requires_grad)
        out, _, y, rstd = _forward(x, weight, cos, sin, eps, quant, fake=True, normed=want_normed,
                                   rstd=needs_grad, rows_per_prog=rows_per_prog)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        ctx.rows_per_prog = rows_per_prog
        if y is not None:
            ctx.mark_non_differentiable(y)
        return out, y

    @staticmethod
    def backward(ctx, g_out, g_normed):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        if g_out is None:
            g_out = torch.zeros_like(x)
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _backward(g_out.to(x.dtype).contiguous(), x, weight, rstd, cos, sin, need_dw=need_dw,
                           rows_per_prog=ctx.rows_per_prog)
        return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------------------
# Public functions


def _reference_rows(x, weight, eps, cos, sin):
    """The model's two passes before the quantiser (model.common.RMSNorm and model.rope.apply_rope are these
    functions): (normed y, rotated)."""
    y = x if weight is None else rms_norm(x, weight, eps)
    return y, apply_rope(y, cos, sin)


def norm_rope_fake_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, weight: torch.Tensor | None = None,
                         eps: float | None = None, quant: str | None, return_normed: bool = False,
                         impl: str = "reference", rows_per_prog: int | None = None):
    """fake_quant(apply_rope(rms_norm(x, weight, eps), cos, sin)) in x's dtype, differentiable in x and weight.

    x [B, T, D] or [B, T, H, D] bf16/fp16/fp32 (contiguous for the kernel); weight [D], eps: the RMSNorm's weight
    and eps (a model.common.RMSNorm's `weight` and `eps`), or weight None for no norm; cos, sin [T, RD / 2]
    (model.rope tables, usually in x's dtype); quant: None, "fp4", "fp4_ue8m0" or "fp8" (see `QUANTS`).
    Returns q (x's shape and dtype), or (q, y) with return_normed: y = rms_norm(x, weight, eps), pre-RoPE, detached.
    The gradient is straight-through at the quantiser, as kernels.fp4.fake_quant's.
    """
    if impl not in _IMPLS:
        raise ValueError(f"norm_rope_fake_quant: impl must be one of {list(_IMPLS)}, got {impl!r}")
    _check(x, weight, eps, cos, sin, quant, "norm_rope_fake_quant")
    if impl == "triton":
        q, y = _NormRopeFakeQuant.apply(x, weight, cos, sin, eps if weight is not None else 0.0, quant,
                                        return_normed, rows_per_prog)
        return (q, y) if return_normed else q
    y, rotated = _reference_rows(x, weight, eps, cos, sin)
    if quant == "fp8":
        q = fp8.fake_quant_fp8(rotated, 32)
    elif quant is not None:
        block, scale_fmt = QUANTS[quant]
        q = fp4.fake_quant(rotated, block, scale_fmt)
    else:
        q = rotated
    return (q, y.detach()) if return_normed else q


def norm_rope_quantize(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, weight: torch.Tensor | None = None,
                       eps: float | None = None, quant: str, return_normed: bool = False, impl: str = "reference",
                       rows_per_prog: int | None = None):
    """The cache record of apply_rope(rms_norm(x, weight, eps), cos, sin): (codes, scales), or (codes, scales, y)
    with return_normed.

    quant "fp4" / "fp4_ue8m0": codes uint8 [..., D / 2] (element 2i in the low nibble), scales e4m3fn / e8m0fnu
    [..., D / block], as kernels.fp4.quantize; "fp8": values float8_e4m3fn [..., D], scales e8m0fnu [..., D / 32], as
    kernels.fp8.quantize_fp8. No gradient (inference). Arguments as `norm_rope_fake_quant`.
    """
    if impl not in _IMPLS:
        raise ValueError(f"norm_rope_quantize: impl must be one of {list(_IMPLS)}, got {impl!r}")
    if quant is None:
        raise ValueError("norm_rope_quantize: quant must be 'fp4', 'fp4_ue8m0' or 'fp8', got None")
    _check(x, weight, eps, cos, sin, quant, "norm_rope_quantize")
    if impl == "triton":
        with torch.no_grad():
            codes, scales, y, _ = _forward(x.detach(), None if weight is None else weight.detach(), cos, sin,
                                           eps if weight is not None else 0.0, quant, fake=False,
                                           normed=return_normed, rstd=False, rows_per_prog=rows_per_prog)
        return (codes, scales, y) if return_normed else (codes, scales)
    with torch.no_grad():
        y, rotated = _reference_rows(x, weight, eps, cos, sin)
    if quant == "fp8":
        codes, scales = fp8.quantize_fp8(rotated, 32)
    else:
        block, scale_fmt = QUANTS[quant]
        codes, scales = fp4.quantize(rotated, block, scale_fmt)
    return (codes, scales, y) if return_normed else (codes, scales)
