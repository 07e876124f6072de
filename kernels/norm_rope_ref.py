"""Plain-PyTorch RMSNorm and RoPE on tensors: the reference passes that kernels.norm_rope_fp4 fuses.

They live in kernels/ so that the fused kernel's reference needs nothing from model/; the model's own RMSNorm module
(model.common.RMSNorm) and RoPE (model.rope.apply_rope) are these functions, so the reference is the model's code.

Shape legend: T tokens, H heads, D channels, R rotated (trailing) channels; cos/sin tables are [T, R / 2].
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "apply_rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim: statistics in fp32, output in x's dtype. weight [D]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x.

    x: [B, T, D] or [B, T, H, D]; cos/sin: [T, R/2], or [B, T, R/2] (a position per row: the inference cache).
    Returns a tensor of x's dtype.
    """
    half = cos.shape[-1]
    if x.dim() == 4:
        cos, sin = cos[..., None, :], sin[..., None, :]
    c, s = cos.float(), sin.float()
    if inverse:
        s = -s
    rot = x[..., -2 * half:].float().unflatten(-1, (half, 2))
    even, odd = rot[..., 0], rot[..., 1]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((x[..., : -2 * half], out.to(x.dtype)), dim=-1)
