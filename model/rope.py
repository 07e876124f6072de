"""RoPE with YaRN, on the trailing channels, interleaved pairs (REFERENCE A1 "RoPE per layer kind").

Two kinds per layer: "main" (SWA-only layers, theta 1e4, no scaling) and "compress" (every layer with a
compression ratio, window and compressed branch alike: theta 1.6e5 with YaRN factor 16 over an original 64K).
attention_factor is 1 (no mscale). Only the last `rope_dim` channels rotate; pair i is channels (2i, 2i+1) of
that tail, rotated by angle p * inv_freq_i. Inverse RoPE (sin negated) is applied to the attention output at the
query position. Angles are fp32; cos/sin are rounded to the activation dtype as the reference does, and the rotation
runs in fp32.

The rotation, `apply_rope`, is kernels.norm_rope_ref.apply_rope re-exported: the fused norm + RoPE kernel's reference
(kernels/norm_rope_fp4.py) calls the same function without importing the model.

No buffers: the tables are cheap (T x rope_dim/2) and recomputing them keeps the module meta-device friendly.
"""

from __future__ import annotations

import math

import torch

from kernels.norm_rope_ref import apply_rope  # noqa: F401 (the rotation; kept in kernels/ beside the fused kernel)
from model.config import AttentionConfig


def _yarn_bounds(rope_dim: int, base: float, original_max: int, beta_fast: float, beta_slow: float):
    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    return low, high


def inv_freq(cfg: AttentionConfig, kind: str, device=None) -> torch.Tensor:
    """[rope_dim / 2] fp32 inverse frequencies for a layer kind ("main" or "compress")."""
    r = cfg.rope_dim
    base = cfg.rope_theta if kind == "main" else cfg.compress_rope_theta
    theta = base ** (-torch.arange(0, r, 2, dtype=torch.float64, device=device) / r)
    if kind == "main" or cfg.yarn_factor == 1.0:
        return theta.float()
    low, high = _yarn_bounds(r, base, cfg.yarn_original_max_pos, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
    if low == high:
        high += 1e-3  # avoid a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    # pairs below `low` keep their frequency (extrapolate), above `high` are divided by the factor (interpolate)
    return (theta * (1 - ramp) + theta / cfg.yarn_factor * ramp).float()


def rope_tables(cfg: AttentionConfig, kind: str, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [..., rope_dim / 2] for integer positions [...] ([T], or [B, T] with a position per row),
    rounded to `dtype`."""
    angles = positions.to(torch.float32)[..., None] * inv_freq(cfg, kind, positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)
