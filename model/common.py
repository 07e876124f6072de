"""Small building blocks shared by the model files."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Weighted RMSNorm; statistics in fp32, output in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def linear(in_dim: int, out_dim: int) -> nn.Linear:
    """Bias-free linear layer (the architecture has no biases)."""
    return nn.Linear(in_dim, out_dim, bias=False)


def init_linear(module: nn.Linear, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
