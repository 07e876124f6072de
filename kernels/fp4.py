"""FP4 E2M1 block quantisation (main KV, indexer q/k) and KV-cache record sizes: plain-PyTorch references for
REFERENCE A9 (fake quantisation), B2 (cache records) and SPEC 1.4; the FP8 functions of `kernels.fp8` are
re-exported here.

Contract: `quantize(x [..., D], block, scale_fmt)` -> (codes uint8 [..., D // 2], two E2M1 codes a byte, element 2i
in the low nibble; scales [..., D // block]: float8_e4m3fn for scale_fmt="e4m3" (main KV, block 16) or
float8_e8m0fnu for "ue8m0" (indexer, block 32)); a value is grid(clamp(x / scale, +-6)), round to nearest, ties to
the even code; no per-tensor scale. `dequantize` returns float32; `fake_quant` is their composition in x's dtype
with a straight-through gradient. Every function takes impl: "reference" (here) or "triton" (kernels.fp4_triton,
bit-identical). `record_bytes` gives the cache records' sizes.

Design and reasoning: docs/kernels.md#fp4-formats
"""

from __future__ import annotations

import torch

from kernels.fp8 import dequantize_fp8, fake_quant_fp8, pow2_ceil, quantize_fp8, straight_through
from kernels.quant_common import FP8_MAX, check_blocked, check_impl, check_scales

__all__ = [
    "quantize",
    "dequantize",
    "fake_quant",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quant_fp8",
    "record_bytes",
    "FP4_GRID",
]

FP4_MAX = 6.0
"""largest E2M1 magnitude"""
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes, indexed by the 3-bit magnitude code"""

# Round to nearest, ties to the even code, written as "code = number of thresholds |v| reaches" so it
# is a pure compare-and-add (the form a Triton kernel will use). The midpoints whose lower neighbour
# has the odd code round up, so their compare is inclusive; the others round down, so strict.
_THRESH_INCLUSIVE = (0.75, 1.75, 3.5)  # 0.5|1, 1.5|2, 3|4: ties go up to codes 2, 4, 6
_THRESH_STRICT = (0.25, 1.25, 2.5, 5.0)  # 0|.5, 1|1.5, 2|3, 4|6: ties stay at codes 0, 2, 4, 6

_E4M3_RATIO_FLOOR = 2.0**-9
"""smallest e4m3fn subnormal: the floor on amax / 6 (REFERENCE A9 / B2 clamp [2^-9, 448])"""
_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
"""keeps amax / 6 a normal fp32 number so the exponent trick is exact"""

_SCALE_FMTS = ("e4m3", "ue8m0")
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _block_scales(amax: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """amax fp32 [..., NB, 1] -> (scale as fp32, scale in its storage dtype), both [..., NB, 1]."""
    if scale_fmt == "e4m3":
        # A true division here, as the reference does; the clamp at 448 only matters for amax > 2688,
        # where the e4m3 cast would otherwise saturate anyway (B2 clamps the same range).
        # (a 0-dim tensor divisor: with a Python scalar, CUDA torch multiplies by its reciprocal instead; filled,
        # not copied from the host, so a CUDA graph can capture it)
        ratio = amax.clamp_min(FP4_MAX * _E4M3_RATIO_FLOOR) / amax.new_full((), FP4_MAX)
        scale_e4m3 = ratio.clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
        return scale_e4m3.float(), scale_e4m3
    # ue8m0: multiply by the fp32 reciprocal of 6, then the exact power-of-two ceiling.
    inv_max = torch.full((), 1.0 / FP4_MAX, dtype=torch.float32, device=amax.device)  # (filled: see above)
    return pow2_ceil(amax.clamp_min(_UE8M0_AMAX_FLOOR) * inv_max)


def _encode(v: torch.Tensor) -> torch.Tensor:
    """Scaled fp32 values (already in [-6, 6]) -> 4-bit codes as uint8, same shape."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _THRESH_INCLUSIVE:
        code += mag >= t
    for t in _THRESH_STRICT:
        code += mag > t
    # Sign only on nonzero magnitudes, so -0 and tiny negatives both encode as +0 (code 0).
    negative = (v < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def _decode_table(device: torch.device) -> torch.Tensor:
    """fp32 [16]: nibble -> signed grid value (nibble 8 decodes to 0, though we never write it)."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=device)
    return torch.cat([grid, -grid]) + 0.0  # `+ 0.0` turns the -0 entry into +0


_PAIR_TABLES: dict = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: byte -> (its low nibble's value, its high nibble's value)."""
    key = str(device)
    if key not in _PAIR_TABLES:
        table = _decode_table(device)
        b = torch.arange(256, device=device)
        _PAIR_TABLES[key] = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1)
    return _PAIR_TABLES[key]


def _triton():
    """kernels.fp4_triton, imported on the first impl="triton" call."""
    from kernels import fp4_triton  # triton is an optional dependency (none off Linux): the reference runs without it

    return fp4_triton


def quantize(
    x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *, impl: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP4: x [..., D] any float dtype -> (codes uint8 [..., D // 2], scales [..., NB])."""
    check_impl(impl, "quantize")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"quantize: scale_fmt must be one of {list(_SCALE_FMTS)}, got {scale_fmt!r}")
    if impl == "triton":
        return _triton().quantize(x, block, scale_fmt)
    num_blocks = check_blocked(x, block, "quantize", even=True)
    x_blk = x.detach().float().unflatten(-1, (num_blocks, block))  # [..., NB, block]
    amax = x_blk.abs().amax(dim=-1, keepdim=True)  # [..., NB, 1]
    scale_f32, scale_stored = _block_scales(amax, scale_fmt)
    v = (x_blk / scale_f32).clamp(-FP4_MAX, FP4_MAX)  # [..., NB, block]
    code = _encode(v).flatten(-2)  # [..., D]
    packed = code[..., 0::2] | (code[..., 1::2] << 4)  # [..., D // 2]
    return packed, scale_stored.squeeze(-1)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int = 16, *, impl: str = "reference"
) -> torch.Tensor:
    """codes uint8 [..., D // 2], scales e4m3fn/e8m0fnu [..., NB] -> float32 [..., D]."""
    check_impl(impl, "dequantize")
    if impl == "triton":
        return _triton().dequantize(codes, scales, block)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"dequantize: codes must be torch.uint8 (two FP4 codes per byte), got {got}")
    if codes.dim() == 0:
        raise ValueError("dequantize: codes must have at least one dim, got a 0-dim tensor")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"dequantize: block must be a positive int, got {block!r}")
    dim = 2 * codes.shape[-1]
    if dim % block != 0:
        raise ValueError(f"dequantize: unpacked last dim {dim} is not divisible by block={block}")
    num_blocks = dim // block
    check_scales(scales, codes.shape[:-1], num_blocks, "dequantize")
    if scales.dtype not in _SCALE_DTYPES:
        raise TypeError(f"dequantize: scales must be float8_e4m3fn or float8_e8m0fnu, got {scales.dtype}")
    # Unpack: low nibble is the even element, high nibble the odd one; one lookup per byte gives both.
    values = torch.nn.functional.embedding(codes.long(), _pair_table(codes.device)).flatten(-2)  # [..., D]
    out = values.unflatten(-1, (num_blocks, block)) * scales.float().unsqueeze(-1)
    return out.flatten(-2)


def fake_quant(
    x: torch.Tensor, block: int = 16, scale_fmt: str = "e4m3", *, impl: str = "reference"
) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype, with a straight-through gradient to x.

    The reference has no straight-through estimator (no gradient to x except, for e4m3, through each
    block's amax); we pass the gradient through unchanged so QAT can train the layers feeding the cache.
    """
    check_impl(impl, "fake_quant")
    if impl == "triton":
        return straight_through(x, _triton().fake_quant(x, block, scale_fmt))
    codes, scales = quantize(x, block, scale_fmt, impl=impl)
    return straight_through(x, dequantize(codes, scales, block, impl=impl).to(x.dtype))


# Per-format (bits per value, channels per scale, bytes per scale) of one cache record.
_RECORD_FORMATS = {
    # Main KV (nvfp4_ds_mla): 4-bit e2m1 + one e4m3 byte per 16 -> 512 dims = 256 + 32 = 288 B.
    "fp4": (4, 16, 1),
    # Indexer key (MXFP4): 4-bit e2m1 + one ue8m0 byte per 32 -> 128 dims = 64 + 4 = 68 B.
    "fp4_ue8m0": (4, 32, 1),
    # SWA window KV (MXFP8, SM100 record): e4m3 + one ue8m0 byte per 32 -> 512 dims = 512 + 16 = 528 B.
    # For a 128-dim indexer key this is 132 B, the same size as vLLM's FP8 key (128 B + one fp32 scale).
    "fp8": (8, 32, 1),
    # Unquantised: 2 B per dim, no scales.
    "bf16": (16, 1, 0),
}


def record_bytes(dim: int, fmt: str) -> int:
    """Bytes one token's `dim`-channel vector occupies in the inference cache in format `fmt`.

    fmt: "fp4" (e4m3 scale per 16), "fp4_ue8m0" (ue8m0 scale per 32), "fp8" (ue8m0 scale per 32) or
    "bf16". Page padding and alignment (B2) are the planner's business, not counted here.
    """
    if fmt not in _RECORD_FORMATS:
        raise ValueError(f"record_bytes: fmt must be one of {list(_RECORD_FORMATS)}, got {fmt!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"record_bytes: dim must be a positive int, got {dim!r}")
    bits, per_scale, scale_bytes = _RECORD_FORMATS[fmt]
    if dim % per_scale != 0 or (dim * bits) % 8 != 0:
        raise ValueError(f"record_bytes: dim {dim} is not divisible by the {fmt} block of {per_scale}")
    return dim * bits // 8 + (dim // per_scale) * scale_bytes
