"""Helpers shared by the Triton kernels of kernels/: host-side checks, the bit-level device helpers of the FP4 / FP8
block formats, tile loads and stores, the quantisers' launch variants, and the interpreter-exact dot.

Every kernel module imports these from here (kernels.fp4_triton, kernels.fp8_triton, kernels.norm_rope_fp4,
kernels.mhc_triton, kernels.mhc_coeffs_triton, kernels.engram_triton, kernels.sparse_attention*, kernels.indexer,
kernels.topk), so no kernel module reaches into another's private names. The module imports nothing from model/.

Why the device helpers look the way they do (kernels/fp4_triton.py says more): rounding is done with integer bit
operations (e4m3, e8m0, bf16), never with Triton's float8/bf16 casts, so the result is fixed by the bits on the GPU
and in the CPU interpreter alike (the interpreter's bf16 casts round wrongly; fp8 cast rounding is backend
specific). Signs are moved as bits too: Triton negates a float as 0 - x, which turns -0 into +0. A "pair word" is
two neighbouring channels (2i, 2i + 1) read as one machine word: two bf16 or fp16 in an int32, two fp32 in an int64.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.quant_common import FP8_AMAX_FLOOR as _FP8_AMAX_FLOOR_VALUE
from kernels.quant_common import FP8_MAX as _FP8_MAX_VALUE

# Element kinds a kernel reads or writes, by the word it uses for a channel pair.
_BF16, _FP16, _FP32 = 0, 1, 2
ELEMENT_KIND = {torch.bfloat16: _BF16, torch.float16: _FP16, torch.float32: _FP32}
PAIR_WORD = {_BF16: torch.int32, _FP16: torch.int32, _FP32: torch.int64}

# Constants the kernels read (Triton only lets jitted code see globals wrapped as constexpr).
E4M3_RATIO_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-9)  # amax floor of the e4m3-scaled FP4: ratio >= 2^-9
UE8M0_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-126)  # keeps amax / 6 a normal fp32
INV_SIX = tl.constexpr(1.0 / 6.0)
_TWO_POW_M127 = tl.constexpr(2.0**-127)
# kernels.quant_common's FP8 constants as the FP8 kernels read them
FP8_MAX = tl.constexpr(_FP8_MAX_VALUE)
FP8_INV_MAX = tl.constexpr(1.0 / _FP8_MAX_VALUE)  # rounded to fp32 where used, like the reference's fp32 reciprocal
FP8_AMAX_FLOOR = tl.constexpr(_FP8_AMAX_FLOOR_VALUE)


# ------------------------------------------------------------------------------------------------------------
# Host-side checks


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
# Device helpers: bf16 rounding, channel pairs, the e4m3 / e8m0 / e2m1 codes, block tiles


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
def unpack_pair(w, KIND: tl.constexpr):
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
def magnitude(bits):
    """int32 bits of an fp32 -> |value| as fp32 (clearing the sign bit keeps -0 and NaN handling out)."""
    return (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def with_sign(val, bits, cond):
    """|val| with the sign bit of `bits` where `cond` (val >= 0)."""
    sign = tl.where(cond, bits & -2147483648, 0)
    return (val.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def pack_pair(lo, hi, KIND: tl.constexpr):
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
def e4m3_mag(a):
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
def e4m3_value(code):
    """float8_e4m3fn bits (int32) -> fp32 value (0x7F / 0xFF decode to NaN)."""
    e = (code >> 3) & 0xF
    m = (code & 7).to(tl.float32)
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2^(e - 10)
    val = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)  # subnormal step 2^-9
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    return with_sign(val, code << 24, True)


@triton.jit
def e8m0_value(code):
    """float8_e8m0fnu bits (int32) -> fp32 2^(code - 127); 0 is the fp32 subnormal 2^-127, 255 is NaN."""
    val = tl.where(code == 0, _TWO_POW_M127, (code << 23).to(tl.float32, bitcast=True))
    return tl.where(code == 255, float("nan"), val)


@triton.jit
def pow2_reciprocal(e):
    """Biased exponent e in [0, 254] of a power of two -> its exact reciprocal (2^-127 is an fp32 subnormal)."""
    return tl.where(e < 254, (254 - e) << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil(t):
    """Positive fp32 -> (2^ceil(log2 t) as fp32, its biased exponent = the e8m0 code), from the bits."""
    bits = t.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(e, 255)
    return (e << 23).to(tl.float32, bitcast=True), e


@triton.jit
def e2m1_mag(q):
    """Scaled magnitude q >= 0 -> 3-bit magnitude code (int32): the count of thresholds q reaches, ties to even.
    Values past 6 count all seven, which is what the reference's clamp to 6 gives."""
    code = (q >= 0.75).to(tl.int32) + (q >= 1.75).to(tl.int32) + (q >= 3.5).to(tl.int32)
    return code + (q > 0.25).to(tl.int32) + (q > 1.25).to(tl.int32) + (q > 2.5).to(tl.int32) + (q > 5.0).to(tl.int32)


@triton.jit
def e2m1_grid(m):
    """3-bit magnitude code (int32) -> fp32 grid value {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    m = m.to(tl.float32)
    return tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))


@triton.jit
def e2m1_value(nib):
    """4-bit code (int32) -> signed fp32 grid value; code 8 ("-0") gives +0 like the reference's table."""
    return with_sign(e2m1_grid(nib & 7), nib << 28, (nib & 7) != 0)


@triton.jit
def fp4_code(bits, q):
    """fp32 bits of x and its scaled magnitude q -> 4-bit code; -0 and negatives rounding to 0 encode as +0."""
    m = e2m1_mag(q)
    return m | tl.where(m > 0, (bits >> 28) & 8, 0), m


@triton.jit
def load_blocks(x_ptr, tile, num_blocks, N: tl.constexpr, P: tl.constexpr):
    """The [P, N] tile of blocks tile * P ... from an array of N elements (or pair words) per block; 0 past the end."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    offs = blk[:, None] * N + tl.arange(0, N)[None, :]
    return tl.load(x_ptr + offs, mask=(blk < num_blocks)[:, None], other=0)


@triton.jit
def store_bytes(ptr, tile, bytes_, num_blocks, P: tl.constexpr, N: tl.constexpr):
    """Store the int32 bytes [P, N] of blocks tile * P ... (N per block) to the uint8 array at ptr, byte by byte."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    live = blk < num_blocks
    offs = blk[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(ptr + offs, bytes_.to(tl.uint8), mask=live[:, None])


@triton.jit
def store_scale_bytes(ptr, tile, code, num_blocks, P: tl.constexpr):
    """Scale codes int32 [P] of blocks tile * P ... -> uint8 at ptr."""
    blk = tile.to(tl.int64) * P + tl.arange(0, P)
    tl.store(ptr + blk, code.to(tl.uint8), mask=blk < num_blocks)


# ------------------------------------------------------------------------------------------------------------
# Launch settings of the FP4 and FP8 quantisers (host)


def resolve_blocks_per_prog(block: int, blocks_per_prog: int | None) -> int:
    """Blocks per program of a quantising launch: `blocks_per_prog` if given, else the default below."""
    # ~2048 channels per program. On the H200 the [32768, 512] e4m3 case took 31-37 us for 1024 to 4096
    # channels per program with 4 warps (bench/kernel_cases/fp4.py sweep), so the choice is not critical.
    return blocks_per_prog or max(1, 2048 // block)


VARIANTS = {
    # The first kernel: threshold-count encoding, one tile per program.
    "base": dict(ENCODE=0, PERSISTENT=False),
    # Fewer instructions: the E2M1 code from one rounding add (kernels.fp4_triton._e2m1_mag_rn) instead of seven
    # compares, the signs of a code byte's two nibbles in one masked or (_fp4_pair_byte there), amax / 6 as a
    # three-flop exact quotient.
    "rn": dict(ENCODE=1, PERSISTENT=False),
    # rn, with a grid of a few programs per SM looping over the tiles, each loading its next tile first.
    "persistent": dict(ENCODE=1, PERSISTENT=True),
}
"""Kernel variants the FP4 and FP8 quantisers take as `variant=`, all bit-identical (tests/kernels/test_fp4_triton.py);
bench/kernel_cases/fp4.py sweeps them. In the FP8 kernel (kernels.fp8_triton) ENCODE=1 rounds to E4M3 by one add
(its _e4m3_mag_rn). Word-packed code and scale stores ("packed", "packed64") were slower than "rn" on the H200 and
are gone."""

DEFAULT_VARIANT = "rn"


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a grid smaller than the tiles, so the tests walk the loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def variant_launch(variant: str, fn_name: str, x: torch.Tensor, num_tiles: int, num_warps: int
                   ) -> tuple[tuple[int], dict]:
    """(grid, constexprs) of a quantising launch (FP4 or FP8) of `num_tiles` tiles."""
    if variant not in VARIANTS:
        raise ValueError(f"{fn_name}: variant must be one of {list(VARIANTS)}, got {variant!r}")
    opts = dict(VARIANTS[variant])
    grid = num_tiles
    if opts["PERSISTENT"]:
        # Enough programs to fill every SM at full occupancy (2048 threads), no more: the loop does the rest.
        grid = min(num_tiles, num_sms(x.device) * max(1, 2048 // (32 * num_warps)))
    return (grid,), opts


# ------------------------------------------------------------------------------------------------------------
# Dots and masks (sparse attention and the indexer)


def dot_prec(dtype: torch.dtype) -> str:
    """The dots' PREC constexpr: exact fp32 dots for fp32 inputs, fp32 operands for 16-bit inputs under the CPU
    interpreter (see `dot`), else the 16-bit tensor-core path (which ignores the setting)."""
    if dtype == torch.float32:
        return "ieee"
    return "interp" if interpreting() else "tf32"


@triton.jit
def dot(a, b, acc, PREC: tl.constexpr):
    """tl.dot with the accumulator `acc` (or None). The CPU interpreter multiplies 16-bit operands wrongly, so under
    it (PREC == "interp") the operands go in as fp32; on the GPU they stay 16-bit for the tensor cores."""
    if PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def rows_mask(rows_ok, cols, D: tl.constexpr, FULL: tl.constexpr):
    """[R] row mask, [C] channel offsets -> [R, C] mask. When D fills the tile (FULL) the channel test is a
    compile-time constant, which keeps the loads 16-byte vectorised (and eligible for async copies)."""
    if FULL:
        return rows_ok[:, None] & tl.full([1, cols.shape[0]], 1, tl.int1)
    else:
        return rows_ok[:, None] & (cols < D)[None, :]
