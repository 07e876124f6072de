"""Triton kernels for FP4 E2M1 and FP8 E4M3 block quantisation, bit-exact with `kernels.fp4` / `kernels.fp8`.

The PyTorch references (`impl="reference"`) sit in kernels/fp4.py and kernels/fp8.py and define the contract
(formats, rounding, scale rules); every kernel here reproduces them bit for bit for finite inputs (NaN/inf
inputs are out of contract: their codes may differ). `kernels.fp4.quantize(..., impl="triton")` and friends
route here.

Shape legend:
    R    rows: all leading dims flattened (tokens x heads); blocks never straddle rows since D % block == 0
    D    channels, the last dim
    NB   R * D // block, the total number of blocks (one scale each)
    P    blocks handled by one program

Why the kernels look the way they do:
- Everything is fp32 inside. Rounding is done with integer bit operations (e4m3, e8m0, bf16), never with
  Triton's float8/bf16 casts: that gives one code path whose result is fixed by the bits, on the GPU and in
  the CPU interpreter alike (the interpreter's bf16 casts round wrongly, and fp8 cast rounding is backend
  specific). Signs are moved as bits too: Triton negates a float as 0 - x, which turns -0 into +0.
- The reference divides by the scale (IEEE division). A power-of-two scale is a multiply by its exact
  reciprocal. An e4m3 scale s gets y = RN(1/s) once per block, then per element q = a*y, r = fma(-q, s, a),
  q' = fma(r, y, q): this is the correctly rounded a/s (Markstein's theorem; checked exhaustively for all fp32
  significands against all eight e4m3 significands), three flops instead of a full division.
- FP4 packs two codes per byte, element 2i in the low nibble. The kernels read and write the channel *pairs*
  as one machine word (two bf16 in an int32, two fp32 in an int64), so the pairing costs no shuffles and the
  loads stay 16-byte vectors.
- One program owns P whole blocks laid out as a [P, block / 2] tile of words, so a block's amax is a row
  reduction inside the program and the scales of the tile are a contiguous [P] store.

The shared helpers at the top (bf16 rounding, device checks) are also used by kernels.mhc_triton and
kernels.engram_triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_AMAX_FLOOR, FP8_MAX, check_blocked, check_scales

__all__ = [
    "quantize",
    "dequantize",
    "fake_quant",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quant_fp8",
]

# Element kinds a kernel reads or writes, by the word it uses for a channel pair.
_BF16, _FP16, _FP32 = 0, 1, 2
_KIND = {torch.bfloat16: _BF16, torch.float16: _FP16, torch.float32: _FP32}
_PAIR_WORD = {_BF16: torch.int32, _FP16: torch.int32, _FP32: torch.int64}

# Constants the kernels read (Triton only lets jitted code see globals wrapped as constexpr).
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_INV_MAX = tl.constexpr(1.0 / FP8_MAX)  # rounded to fp32 where used, like the reference's fp32 reciprocal
_FP8_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
_E4M3_RATIO_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-9)  # amax floor of the e4m3-scaled FP4: ratio >= 2^-9
_UE8M0_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-126)  # keeps amax / 6 a normal fp32
_INV_SIX = tl.constexpr(1.0 / 6.0)
_TWO_POW_M127 = tl.constexpr(2.0**-127)


# ------------------------------------------------------------------------------------------------------------
# Shared helpers (host)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1): the tests' mode."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, fn_name: str, *tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors in the interpreter; all on one device, all contiguous."""
    first = tensors[0]
    for t in tensors:
        if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
            raise ValueError(
                f"{fn_name}: {name} must be CUDA tensors (or CPU with TRITON_INTERPRET=1), got device {t.device}"
            )
        if t.device != first.device:
            raise ValueError(f"{fn_name}: {name} must share one device, got {first.device} and {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn_name}: {name} must be contiguous (call .contiguous() first)")


def word_view(t: torch.Tensor, word: torch.dtype, fn_name: str) -> torch.Tensor:
    """Reinterpret a contiguous tensor as machine words (two channels each); needs an aligned start."""
    try:
        return t.view(word)
    except RuntimeError as e:
        raise ValueError(f"{fn_name}: cannot read channel pairs as {word} words ({e}); pass an aligned copy") from e


# ------------------------------------------------------------------------------------------------------------
# Shared helpers (device)


@triton.jit
def bf16_bits(x):
    """fp32 -> the bf16 bit pattern (round to nearest even) in the low 16 bits of an int32; finite x."""
    b = x.to(tl.int32, bitcast=True)
    # Adding 0x7FFF plus the kept LSB rounds to nearest, ties to even; a mantissa carry bumps the exponent.
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def bf16_round(x):
    """fp32 -> fp32 holding the bf16 value nearest to x (what a store to bf16 and reload gives)."""
    return (bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_pair(w, KIND: tl.constexpr):
    """A word holding channels (2i, 2i+1) -> (even, odd) as the int32 bit patterns of their fp32 values."""
    if KIND == 0:  # bf16 x2 in int32: a bf16 is the top half of the fp32 with the same value
        return w << 16, w & -65536
    elif KIND == 1:  # fp16 x2 in int32
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
    else:  # fp32 x2 in int64
        return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def _magnitude(bits):
    """int32 bits of an fp32 -> |value| as fp32 (clearing the sign bit keeps -0 and NaN handling out)."""
    return (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _with_sign(val, bits, cond):
    """|val| with the sign bit of `bits` where `cond` (val >= 0)."""
    sign = tl.where(cond, bits & -2147483648, 0)
    return (val.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _pack_pair(lo, hi, KIND: tl.constexpr):
    """(even, odd) fp32 -> one word in the element kind, each rounded to nearest even."""
    if KIND == 0:
        return bf16_bits(lo) | (bf16_bits(hi) << 16)
    elif KIND == 1:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo16 | (hi16 << 16)
    else:
        lo32 = lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return lo32 | (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32)


@triton.jit
def _e4m3_mag(a):
    """fp32 0 <= a <= 448 -> float8_e4m3fn bits of its magnitude (int32 0..126), round to nearest even."""
    mag = a.to(tl.int32, bitcast=True)
    exp = tl.maximum(mag >> 23, 1)  # fp32 subnormals behave as exponent 1 without the implicit bit
    sig = tl.where((mag >> 23) > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    # e4m3 keeps 3 mantissa bits: drop 20 of fp32's 23, more below 2^-6 where e4m3 is subnormal (step 2^-9).
    # Biased exponent 121 is 2^-6; the shift is capped at 31, which rounds anything that small to 0.
    shift = tl.minimum(20 + tl.maximum(121 - exp, 0), 31)
    rounded = (sig + ((1 << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift
    # Normal range: rounded is 8 + mantissa (16 on a carry, which the exponent term then absorbs).
    return (tl.maximum(exp - 121, 0) << 3) + rounded


@triton.jit
def _e4m3_value(code):
    """float8_e4m3fn bits (int32) -> fp32 value (0x7F / 0xFF decode to NaN)."""
    e = (code >> 3) & 0xF
    m = (code & 7).to(tl.float32)
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
    val = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)  # subnormal step 2^-9
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    return _with_sign(val, code << 24, True)


@triton.jit
def _e8m0_value(code):
    """float8_e8m0fnu bits (int32) -> fp32 2^(code - 127); 0 is the fp32 subnormal 2^-127, 255 is NaN."""
    val = tl.where(code == 0, _TWO_POW_M127, (code << 23).to(tl.float32, bitcast=True))
    return tl.where(code == 255, float("nan"), val)


@triton.jit
def _pow2_reciprocal(e):
    """Biased exponent e in [0, 254] of a power of two -> its exact reciprocal (2^-127 is an fp32 subnormal)."""
    return tl.where(e < 254, (254 - e) << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_ceil(t):
    """Positive fp32 -> (2^ceil(log2 t) as fp32, its biased exponent = the e8m0 code), from the bits."""
    bits = t.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(e, 255)
    return (e << 23).to(tl.float32, bitcast=True), e


@triton.jit
def _e2m1_mag(q):
    """Scaled magnitude q >= 0 -> 3-bit magnitude code (int32): the count of thresholds q reaches, ties to even.
    Values past 6 count all seven, which is what the reference's clamp to 6 gives."""
    code = (q >= 0.75).to(tl.int32) + (q >= 1.75).to(tl.int32) + (q >= 3.5).to(tl.int32)
    return code + (q > 0.25).to(tl.int32) + (q > 1.25).to(tl.int32) + (q > 2.5).to(tl.int32) + (q > 5.0).to(tl.int32)


@triton.jit
def _e2m1_grid(m):
    """3-bit magnitude code (int32) -> fp32 grid value {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    m = m.to(tl.float32)
    return tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))


@triton.jit
def _e2m1_value(nib):
    """4-bit code (int32) -> signed fp32 grid value; code 8 ("-0") gives +0 like the reference's table."""
    return _with_sign(_e2m1_grid(nib & 7), nib << 28, (nib & 7) != 0)


@triton.jit
def _fp4_code(bits, q):
    """fp32 bits of x and its scaled magnitude q -> 4-bit code; -0 and negatives rounding to 0 encode as +0."""
    m = _e2m1_mag(q)
    return m | tl.where(m > 0, (bits >> 28) & 8, 0), m


# ------------------------------------------------------------------------------------------------------------
# FP4 E2M1


@triton.jit
def _fp4_quant_kernel(x_ptr, codes_ptr, scales_ptr, fake_ptr, num_blocks,
                      BLOCK: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FAKE: tl.constexpr,
                      P: tl.constexpr):
    """x words [NB * BLOCK / 2] -> codes uint8 [NB * BLOCK / 2] + scale bits uint8 [NB], or (FAKE) the
    dequantised values as words of x's kind."""
    HALF: tl.constexpr = BLOCK // 2
    blk = tl.program_id(0).to(tl.int64) * P + tl.arange(0, P)  # [P]
    live = blk < num_blocks
    offs = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [P, HALF] word index
    lo, hi = _unpack_pair(tl.load(x_ptr + offs, mask=live[:, None], other=0), KIND)  # fp32 bits
    a_lo, a_hi = _magnitude(lo), _magnitude(hi)
    amax = tl.maximum(tl.max(a_lo, axis=1), tl.max(a_hi, axis=1))  # [P]
    if UE8M0:
        # amax floored so amax / 6 stays a normal fp32; multiply by fp32(1/6) as the reference does.
        scale, scale_code = _pow2_ceil(tl.maximum(amax, _UE8M0_AMAX_FLOOR) * _INV_SIX)
        inv = _pow2_reciprocal(scale_code)[:, None]
        q_lo, q_hi = a_lo * inv, a_hi * inv  # exact: the quotient by a power of two
    else:
        # A true division, then round to e4m3 (may round down: past-6 quotients then saturate the code).
        ratio = tl.minimum(tl.math.div_rn(tl.maximum(amax, _E4M3_RATIO_AMAX_FLOOR), tl.zeros_like(amax) + 6.0), 448.0)
        scale_code = _e4m3_mag(ratio)
        scale = _e4m3_value(scale_code)
        s = scale[:, None]
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)[:, None]  # RN(1/s): see the module docstring
        q_lo, q_hi = a_lo * inv, a_hi * inv
        q_lo = tl.fma(tl.fma(-q_lo, s, a_lo), inv, q_lo)
        q_hi = tl.fma(tl.fma(-q_hi, s, a_hi), inv, q_hi)
    c_lo, m_lo = _fp4_code(lo, q_lo)
    c_hi, m_hi = _fp4_code(hi, q_hi)
    if FAKE:
        s = scale[:, None]
        out = _pack_pair(_with_sign(_e2m1_grid(m_lo) * s, lo, m_lo > 0),
                         _with_sign(_e2m1_grid(m_hi) * s, hi, m_hi > 0), KIND)
        tl.store(fake_ptr + offs, out, mask=live[:, None])
    else:
        tl.store(codes_ptr + offs, (c_lo | (c_hi << 4)).to(tl.uint8), mask=live[:, None])
        tl.store(scales_ptr + blk, scale_code.to(tl.uint8), mask=live)


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
        scale = _e8m0_value(code)[:, None]
    else:
        scale = _e4m3_value(code)[:, None]
    out = _pack_pair(_e2m1_value(byte & 0xF) * scale, _e2m1_value(byte >> 4) * scale, 2)
    tl.store(out_ptr + offs, out, mask=live[:, None])


def _blocks_per_prog(block: int, blocks_per_prog: int | None) -> int:
    # ~2048 channels per program. On the H200 the [32768, 512] e4m3 case took 31-37 us for 1024 to 4096
    # channels per program with 4 warps (bench/kernel_cases/fp4.py sweep), so the choice is not critical.
    return blocks_per_prog or max(1, 2048 // block)


def _fp4_prepare(x: torch.Tensor, block: int, scale_fmt: str, fn_name: str) -> tuple[torch.Tensor, int, int]:
    """Checks shared by quantize and fake_quant; returns (x in a supported kind, kind, number of blocks)."""
    if scale_fmt not in ("e4m3", "ue8m0"):
        raise ValueError(f"{fn_name}: scale_fmt must be 'e4m3' or 'ue8m0', got {scale_fmt!r}")
    check_blocked(x, block, fn_name, even=True)
    if block % 2 or block & (block - 1):
        raise ValueError(f"{fn_name}: the Triton kernel needs a power-of-two block, got {block}")
    check_device("x", fn_name, x)
    # Other dtypes (fp64, fp8) go through fp32 first, which is the reference's own first step.
    x = x.detach() if x.dtype in _KIND else x.detach().float()
    return x, _KIND[x.dtype], x.numel() // block


def quantize(x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *, blocks_per_prog: int | None = None,
             num_warps: int = 4, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP4 of x [..., D] -> (codes uint8 [..., D // 2], scales e4m3fn or e8m0fnu [..., D // block]).

    Same contract as kernels.fp4.quantize. `out`, if given, is (codes, scales) to write into (tests poison it).
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp4_quant_kernel[(triton.cdiv(num_blocks, p),)](
            word_view(x, _PAIR_WORD[kind], "quantize"), codes, scales.view(torch.uint8), codes, num_blocks,
            BLOCK=block, KIND=kind, UE8M0=ue8m0, FAKE=False, P=p, num_warps=num_warps)
    return codes, scales


def fake_quant(x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *,
               blocks_per_prog: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype in one pass (no codes in memory). No autograd: the caller
    (kernels.fp4.fake_quant) adds the straight-through gradient."""
    orig_dtype = x.dtype
    x, kind, num_blocks = _fp4_prepare(x, block, scale_fmt, "fake_quant")
    out = torch.empty_like(x)
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        words = word_view(out, _PAIR_WORD[kind], "fake_quant")
        _fp4_quant_kernel[(triton.cdiv(num_blocks, p),)](
            word_view(x, _PAIR_WORD[kind], "fake_quant"), words, words, words, num_blocks,
            BLOCK=block, KIND=kind, UE8M0=scale_fmt == "ue8m0", FAKE=True, P=p, num_warps=num_warps)
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp4_dequant_kernel[(triton.cdiv(num_blocks, p),)](
            codes, scales.view(torch.uint8), word_view(out, torch.int64, "dequantize"), num_blocks,
            BLOCK=block, UE8M0=scales.dtype == torch.float8_e8m0fnu, P=p)
    return out


# ------------------------------------------------------------------------------------------------------------
# FP8 E4M3 (SWA KV): one byte per channel, so plain [P, block] tiles and no pair words.


@triton.jit
def _fp8_quant_kernel(x_ptr, values_ptr, scales_ptr, fake_ptr, num_blocks,
                      BLOCK: tl.constexpr, KIND: tl.constexpr, FAKE: tl.constexpr, P: tl.constexpr):
    """x [NB * BLOCK] (bf16/fp16/fp32) -> e4m3 bits uint8 [NB * BLOCK] + e8m0 bits uint8 [NB], or (FAKE) the
    dequantised values (bf16 written as int16 bits, else x's dtype)."""
    blk = tl.program_id(0).to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    bits = tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    a = _magnitude(bits)
    amax = tl.max(a, axis=1)
    # Reference: multiply by fp32(1/448), not divide; the power-of-two ceiling is read from the bits.
    scale, scale_code = _pow2_ceil(tl.maximum(amax, _FP8_AMAX_FLOOR) * _FP8_INV_MAX)
    mag = _e4m3_mag(tl.minimum(a * _pow2_reciprocal(scale_code)[:, None], _FP8_MAX))  # exact quotient
    code = mag | ((bits >> 24) & 0x80)  # the cast keeps the sign, also of values that round to 0
    if FAKE:
        deq = _with_sign(_e4m3_value(mag) * scale[:, None], bits, True)
        if KIND == 0:
            tl.store(fake_ptr + offs, bf16_bits(deq).to(tl.int16), mask=live[:, None])
        else:
            tl.store(fake_ptr + offs, deq.to(fake_ptr.dtype.element_ty), mask=live[:, None])
    else:
        tl.store(values_ptr + offs, code.to(tl.uint8), mask=live[:, None])
        tl.store(scales_ptr + blk, scale_code.to(tl.uint8), mask=live)


@triton.jit
def _fp8_dequant_kernel(values_ptr, scales_ptr, out_ptr, num_blocks, BLOCK: tl.constexpr, P: tl.constexpr):
    """e4m3 bits uint8 [NB * BLOCK] + e8m0 bits uint8 [NB] -> fp32 [NB * BLOCK]."""
    blk = tl.program_id(0).to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    code = tl.load(values_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
    scale = _e8m0_value(tl.load(scales_ptr + blk, mask=live, other=127).to(tl.int32))
    tl.store(out_ptr + offs, _e4m3_value(code) * scale[:, None], mask=live[:, None])


def _fp8_prepare(x: torch.Tensor, block: int, fn_name: str) -> tuple[torch.Tensor, int]:
    check_blocked(x, block, fn_name)
    if block & (block - 1):
        raise ValueError(f"{fn_name}: the Triton kernel needs a power-of-two block, got {block}")
    check_device("x", fn_name, x)
    x = x.detach() if x.dtype in _KIND else x.detach().float()
    return x, x.numel() // block


def quantize_fp8(x: torch.Tensor, block: int = 32, *, blocks_per_prog: int | None = None, num_warps: int = 4,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp8_quant_kernel[(triton.cdiv(num_blocks, p),)](
            x, values.view(torch.uint8), scales.view(torch.uint8), x, num_blocks,
            BLOCK=block, KIND=_KIND[x.dtype], FAKE=False, P=p, num_warps=num_warps)
    return values, scales


def fake_quant_fp8(x: torch.Tensor, block: int = 32, *, blocks_per_prog: int | None = None) -> torch.Tensor:
    """dequantize_fp8(quantize_fp8(x)) in x's dtype in one pass. No autograd (the caller adds the STE)."""
    orig_dtype = x.dtype
    x, num_blocks = _fp8_prepare(x, block, "fake_quant_fp8")
    out = torch.empty_like(x)
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        target = out.view(torch.int16) if x.dtype == torch.bfloat16 else out
        _fp8_quant_kernel[(triton.cdiv(num_blocks, p),)](
            x, target, target, target, num_blocks, BLOCK=block, KIND=_KIND[x.dtype], FAKE=True, P=p)
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp8_dequant_kernel[(triton.cdiv(num_blocks, p),)](
            values.view(torch.uint8), scales.view(torch.uint8), out, num_blocks, BLOCK=block, P=p)
    return out
