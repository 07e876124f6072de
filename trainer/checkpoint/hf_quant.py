"""The quantised weight formats of DeepSeek's released checkpoints, both ways (trainer/checkpoint/hf_io.py reads and
writes them), as config.json's `quantization_config` names them.

Contract: `released_kind(name)` says how the export stores a weight ("fp8_block" matrix, "fp4" routed expert,
"fp8_rows" Engram table, or None: unquantised); `quantise` returns a piece's codes and scales (powers of two at
least amax / max, so no value clips; E2M1 codes round to nearest, ties to even), `dequantise_rows` /
`dequantise_block` / `dequantise_fp4` the values back, reading every scale dtype the files use (`scales_as_float`).
`stored_shape` and `scale_shape` give the shapes in the files; `check_quantisable` refuses a row length a format has
no scales for. The conventions are DeepSeek's V3 / V4 ones; the released V4.1 files have not been checked against
them.

Design and reasoning: docs/checkpoints.md#quantised-weight-formats
"""

from __future__ import annotations

import math
import re

import torch

from kernels.fp4 import dequantize as fp4_dequantize
from kernels.fp4 import quantize as fp4_quantize
from kernels.fp8 import FP8_MAX, pow2_ceil, quantize_fp8

FP4_BLOCK = 32  # channels a scale of an FP4 expert or an FP8 Engram row
BLOCK = (128, 128)  # the export's FP8 weight block, DeepSeek's

# Cedar names of the matrices the released files hold in FP8 blocks (the rest of the linear layers' weights)
QUANTISED_MATRICES = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|compressor\.wkv|indexer\.wq_b|indexer\.wk)"
    r"|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight$")
_EXPERTS = re.compile(r"^layers\.\d+\.ffn\.experts\.w[123]$")
_TABLE = re.compile(r"^layers\.\d+\.engram\.table$")

# The smallest amax a block's scale is taken from: keeps amax / max a normal fp32 number (an all-zero block gets a
# tiny scale and zero codes).
_AMAX_FLOOR = 2.0**-100


def released_kind(name: str) -> str | None:
    """How the released format stores Cedar tensor `name`: "fp8_block", "fp4" (a stacked expert weight, per
    expert), "fp8_rows" (an Engram table), or None (unquantised)."""
    if _EXPERTS.match(name):
        return "fp4"
    if _TABLE.match(name):
        return "fp8_rows"
    if QUANTISED_MATRICES.match(name):
        return "fp8_block"
    return None


def stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape in the file (an FP4 row holds two codes a byte)."""
    return shape[:-1] + (shape[-1] // 2,) if kind == "fp4" else shape


def scale_shape(kind: str, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scales' shape for a weight of (unpacked) `shape`."""
    if kind == "fp8_block":
        return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    return shape[:-1] + (shape[-1] // FP4_BLOCK,)


def check_quantisable(kind: str, name: str, shape: tuple[int, ...]) -> None:
    if kind in ("fp4", "fp8_rows") and shape[-1] % FP4_BLOCK:
        raise ValueError(f"{name}: {shape[-1]} channels a row, not a multiple of {FP4_BLOCK}: no {kind} scales")


def quantise(kind: str, w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (or a piece of rows; for fp8_block a piece whose first row starts a block) -> (its codes as the file
    stores them, its scales as float8_e8m0fnu)."""
    if kind == "fp4":
        codes, scales = fp4_quantize(w, FP4_BLOCK, "ue8m0")
        return codes.view(torch.int8), scales
    if kind == "fp8_rows":
        return quantize_fp8(w, FP4_BLOCK)
    rows, cols = w.shape
    bo, bi = block
    padded = w.new_zeros(math.ceil(rows / bo) * bo, math.ceil(cols / bi) * bi, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.unflatten(0, (-1, bo)).unflatten(-1, (-1, bi))  # [RB, bo, CB, bi]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(_AMAX_FLOOR)  # [RB, CB]
    scale, scale_e8m0 = pow2_ceil(amax * torch.full((), 1.0 / FP8_MAX))
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale_e8m0


def scales_as_float(s: torch.Tensor) -> torch.Tensor:
    """A file's scales as float32: ue8m0 (float8_e8m0fnu, or uint8 exponent bytes), float32 or bfloat16."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.float() - 127.0)
    if not s.dtype.is_floating_point:
        raise ValueError(f"scales of dtype {s.dtype}: expected float8_e8m0fnu, uint8 exponents, float32 or bfloat16")
    return s.float()


def dequantise_fp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP4-packed rows [..., C / 2] (int8 or uint8) with scales [..., C / B] -> float32 [..., C]."""
    codes = codes.view(torch.uint8)
    unit = torch.ones((*codes.shape[:-1], 1), device=codes.device).to(torch.float8_e8m0fnu)  # 2^0: the E2M1 values
    values = fp4_dequantize(codes, unit, block=2 * codes.shape[-1])  # [..., C]: a byte's low nibble, then its high
    per = values.shape[-1] // scales.shape[-1]
    return (values.unflatten(-1, (-1, per)) * scales_as_float(scales).unsqueeze(-1)).flatten(-2)


def dequantise_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows [..., C] with one scale per C / S channels [..., S] -> float32."""
    per = codes.shape[-1] // scales.shape[-1]
    return codes.float() * scales_as_float(scales).repeat_interleave(per, dim=-1)


def dequantise_block(codes: torch.Tensor, scales: torch.Tensor, first_row: int, block: tuple[int, int]) -> torch.Tensor:
    """FP8 rows [first_row, first_row + r) of a block-scaled matrix, `scales` the rows of scale blocks they touch
    (from block first_row // bo on) -> float32."""
    bo, bi = block
    s = scales_as_float(scales).repeat_interleave(bo, 0)[first_row % bo:][:codes.shape[0]]
    return codes.float() * s.repeat_interleave(bi, 1)[:, :codes.shape[1]]
