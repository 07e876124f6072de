"""Triton kernels for FP4 E2M1 block quantisation, bit-exact with `kernels.fp4`, and the helpers they share with the
FP8 E4M3 kernels of kernels.fp8_triton.

The PyTorch references (`impl="reference"`) sit in kernels/fp4.py and kernels/fp8.py and define the contract
(formats, rounding, scale rules); every kernel here and in kernels.fp8_triton reproduces them bit for bit for finite
inputs (NaN/inf inputs are out of contract: their codes may differ). `kernels.fp4.quantize(..., impl="triton")` and
friends route here, `kernels.fp8.quantize_fp8(..., impl="triton")` and friends to kernels.fp8_triton.

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
  loads stay 16-byte vectors. Codes and scales are stored byte by byte: ptxas already stores a block's 8 code
  bytes as one 64-bit word (each thread owns whole blocks), and explicitly word-packed stores (removed) were
  slower on the H200 (BENCHMARKS.md).
- One program owns P whole blocks laid out as a [P, block / 2] tile of words, so a block's amax is a row
  reduction inside the program and the scales of the tile are a contiguous [P] store.
- The quantisers are issue bound rather than memory bound on the H200 unless each element costs ~20
  instructions: the first kernel ("base" in VARIANTS) compiled (sm_90, ptxas) to ~39 SASS instructions per
  element for e4m3/16, "rn" to ~22 (E2M1 code by one rounding add, both nibble signs in one masked or, amax / 6
  without a division).

The shared helpers (bf16 rounding, device checks, e4m3/e8m0 codes, tile loads and stores, the launch variants) are
also used by kernels.fp8_triton, kernels.norm_rope_fp4, kernels.mhc_triton and kernels.engram_triton.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import check_blocked, check_scales

__all__ = ["quantize", "dequantize", "fake_quant"]

# Element kinds a kernel reads or writes, by the word it uses for a channel pair.
_BF16, _FP16, _FP32 = 0, 1, 2
_KIND = {torch.bfloat16: _BF16, torch.float16: _FP16, torch.float32: _FP32}
_PAIR_WORD = {_BF16: torch.int32, _FP16: torch.int32, _FP32: torch.int64}

# Constants the kernels read (Triton only lets jitted code see globals wrapped as constexpr).
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


@triton.jit
def _load_blocks(x_ptr, tile, num_blocks, N: tl.constexpr, P: tl.constexpr):
    """The [P, N] tile of blocks tile * P ... from an array of N elements (or pair words) per block; 0 past the end."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    offs = blk[:, None] * N + tl.arange(0, N)[None, :]
    return tl.load(x_ptr + offs, mask=(blk < num_blocks)[:, None], other=0)


@triton.jit
def _store_bytes(ptr, tile, bytes_, num_blocks, P: tl.constexpr, N: tl.constexpr):
    """Store the int32 bytes [P, N] of blocks tile * P ... (N per block) to the uint8 array at ptr, byte by byte."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(ptr + offs, bytes_.to(tl.uint8), mask=live[:, None])


@triton.jit
def _store_scale_bytes(ptr, tile, code, num_blocks, P: tl.constexpr):
    """Scale codes int32 [P] of blocks tile * P ... -> uint8 at ptr."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    tl.store(ptr + blk, code.to(tl.uint8), mask=blk < num_blocks)


# ------------------------------------------------------------------------------------------------------------
# Shared launch settings (host)


def _blocks_per_prog(block: int, blocks_per_prog: int | None) -> int:
    # ~2048 channels per program. On the H200 the [32768, 512] e4m3 case took 31-37 us for 1024 to 4096
    # channels per program with 4 warps (bench/kernel_cases/fp4.py sweep), so the choice is not critical.
    return blocks_per_prog or max(1, 2048 // block)


VARIANTS = {
    # The first kernel: threshold-count encoding, one tile per program.
    "base": dict(ENCODE=0, PERSISTENT=False),
    # Fewer instructions: the E2M1 code from one rounding add (_e2m1_mag_rn) instead of seven compares, the signs
    # of a code byte's two nibbles in one masked or (_fp4_pair_byte), amax / 6 as a three-flop exact quotient.
    "rn": dict(ENCODE=1, PERSISTENT=False),
    # rn, with a grid of a few programs per SM looping over the tiles, each loading its next tile first.
    "persistent": dict(ENCODE=1, PERSISTENT=True),
}
"""Kernel variants the FP4 and FP8 quantisers take as `variant=`, all bit-identical (tests/kernels/test_fp4_triton.py);
bench/kernel_cases/fp4.py sweeps them. In the FP8 kernel (kernels.fp8_triton) ENCODE=1 rounds to E4M3 by one add
(_e4m3_mag_rn). Word-packed code and scale stores ("packed", "packed64") were slower than "rn" on the H200 and are
gone."""

DEFAULT_VARIANT = "rn"


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a grid smaller than the tiles, so the tests walk the loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def _variant_launch(variant: str, fn_name: str, x: torch.Tensor, num_tiles: int, num_warps: int
                    ) -> tuple[tuple[int], dict]:
    """(grid, constexprs) of a quantising launch (FP4 or FP8) of `num_tiles` tiles."""
    if variant not in VARIANTS:
        raise ValueError(f"{fn_name}: variant must be one of {list(VARIANTS)}, got {variant!r}")
    opts = dict(VARIANTS[variant])
    grid = num_tiles
    if opts["PERSISTENT"]:
        # Enough programs to fill every SM at full occupancy (2048 threads), no more: the loop does the rest.
        grid = min(num_tiles, _num_sms(x.device) * max(1, 2048 // (32 * num_warps)))
    return (grid,), opts


# ------------------------------------------------------------------------------------------------------------
# FP4 E2M1


@triton.jit
def _e2m1_mag_rn(q):
    """Scaled magnitude q >= 0 -> 3-bit magnitude code (int32), equal to `_e2m1_mag` in fewer instructions.
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
    RN(1/6) is the correctly rounded division (module docstring). The reciprocal of the scale feeds the same
    quotient per element. kernels.norm_rope_fp4 keeps its own scale code, two div_rn as in the "base" variant: the
    same result by the argument above, but not the same operations (a division against a reciprocal and two fmas)."""
    ratio = tl.minimum(_exact_quotient(tl.maximum(amax, _E4M3_RATIO_AMAX_FLOOR), 6.0, _INV_SIX), 448.0)
    code = _e4m3_mag(ratio)
    scale = _e4m3_value(code)
    return code, scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _exact_quotient(a, s, y):
    """Correctly rounded a / s from y = RN(1/s) for an e4m3 s (Markstein: see the module docstring)."""
    q = a * y
    return tl.fma(tl.fma(-q, s, a), y, q)


@triton.jit
def _fp4_quant_tile(w, tile, codes_ptr, scales_ptr, fake_ptr, num_blocks,
                    BLOCK: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FAKE: tl.constexpr,
                    P: tl.constexpr, ENCODE: tl.constexpr):
    """Quantise one loaded tile of pair words w [P, BLOCK / 2] (blocks tile * P ...) and store its outputs."""
    HALF: tl.constexpr = BLOCK // 2
    lo, hi = _unpack_pair(w, KIND)  # fp32 bits
    a_lo, a_hi = _magnitude(lo), _magnitude(hi)
    amax = tl.maximum(tl.max(a_lo, axis=1), tl.max(a_hi, axis=1))  # [P]
    if UE8M0:
        # amax floored so amax / 6 stays a normal fp32; multiply by fp32(1/6) as the reference does.
        scale, scale_code = _pow2_ceil(tl.maximum(amax, _UE8M0_AMAX_FLOOR) * _INV_SIX)
        inv = _pow2_reciprocal(scale_code)[:, None]
        q_lo, q_hi = a_lo * inv, a_hi * inv  # exact: the quotient by a power of two
    elif ENCODE == 1:
        scale_code, scale, inv = fp4_e4m3_scale(amax)
        q_lo = _exact_quotient(a_lo, scale[:, None], inv[:, None])
        q_hi = _exact_quotient(a_hi, scale[:, None], inv[:, None])
    else:  # the first kernel's two divisions, kept for comparison
        ratio = tl.minimum(tl.math.div_rn(tl.maximum(amax, _E4M3_RATIO_AMAX_FLOOR), tl.zeros_like(amax) + 6.0), 448.0)
        scale_code = _e4m3_mag(ratio)
        scale = _e4m3_value(scale_code)
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        q_lo = _exact_quotient(a_lo, scale[:, None], inv[:, None])
        q_hi = _exact_quotient(a_hi, scale[:, None], inv[:, None])
    if ENCODE == 1:
        m_lo, m_hi = _e2m1_mag_rn(q_lo), _e2m1_mag_rn(q_hi)
    else:
        m_lo, m_hi = _e2m1_mag(q_lo), _e2m1_mag(q_hi)
    if FAKE:
        s = scale[:, None]
        out = _pack_pair(_with_sign(_e2m1_grid(m_lo) * s, lo, m_lo > 0),
                         _with_sign(_e2m1_grid(m_hi) * s, hi, m_hi > 0), KIND)
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
        _store_bytes(codes_ptr, tile, byte, num_blocks, P, HALF)
        _store_scale_bytes(scales_ptr, tile, scale_code, num_blocks, P)


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
        w = _load_blocks(x_ptr, pid, num_blocks, HALF, P)
        for i in range(0, tl.cdiv(tl.cdiv(num_blocks, P) - pid, step)):  # the grid is no larger than the tiles
            tile = pid + i * step
            w_next = _load_blocks(x_ptr, tile + step, num_blocks, HALF, P)  # all masked past the end
            _fp4_quant_tile(w, tile, codes_ptr, scales_ptr, fake_ptr, num_blocks, BLOCK, KIND, UE8M0, FAKE, P, ENCODE)
            w = w_next
    else:
        tile = tl.program_id(0)
        _fp4_quant_tile(_load_blocks(x_ptr, tile, num_blocks, HALF, P), tile, codes_ptr, scales_ptr, fake_ptr,
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
        scale = _e8m0_value(code)[:, None]
    else:
        scale = _e4m3_value(code)[:, None]
    out = _pack_pair(_e2m1_value(byte & 0xF) * scale, _e2m1_value(byte >> 4) * scale, 2)
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
    x = x.detach() if x.dtype in _KIND else x.detach().float()
    return x, _KIND[x.dtype], x.numel() // block


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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        grid, opts = _variant_launch(variant, "quantize", x, triton.cdiv(num_blocks, p), num_warps)
        _fp4_quant_kernel[grid](
            word_view(x, _PAIR_WORD[kind], "quantize"), codes, scales.view(torch.uint8), codes, num_blocks,
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        words = word_view(out, _PAIR_WORD[kind], "fake_quant")
        grid, opts = _variant_launch(variant, "fake_quant", x, triton.cdiv(num_blocks, p), num_warps)
        _fp4_quant_kernel[grid](
            word_view(x, _PAIR_WORD[kind], "fake_quant"), words, words, words, num_blocks,
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
    p = _blocks_per_prog(block, blocks_per_prog)
    if num_blocks:
        _fp4_dequant_kernel[(triton.cdiv(num_blocks, p),)](
            codes, scales.view(torch.uint8), word_view(out, torch.int64, "dequantize"), num_blocks,
            BLOCK=block, UE8M0=scales.dtype == torch.float8_e8m0fnu, P=p)
    return out
