"""One mHC block of the backbone (and of the DSpark drafter): Engram (if any), the attention site, the FFN site.

Block order (REFERENCE A6 "The lag"): Engram (if any) updates the streams first; the attention site predicts its
coefficients from the streams and the attention reads the streams collapsed with the PREVIOUS site's `pre`; the FFN
site predicts its coefficients from the updated streams and the FFN reads them collapsed with the attention site's
`pre`. That lag is what lets residual update, input mixing and coefficient prediction run as one pass (model/mhc.py).
A decoder Full layer compresses its global KV from its own norm of h_{L/2} (`state.h_mid`), never from its stream.
A block reads what earlier blocks made from the `ForwardState` and returns what it makes (`LayerOutputs`).
"""

from __future__ import annotations

import torch
from torch import nn

from model import kernels as kern
from model import mhc
from model.attention import CSA2Attention
from model.common import RMSNorm
from model.config import ModelConfig
from model.engram import Engram
from model.forward import ForwardState
from model.layer_plan import LayerSpec
from model.moe import MoE

__all__ = ["Block"]


class Block(kern.KernelPath, nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.impl = cfg.mhc.impl
        self.kernels = cfg.kernels
        self.engram = Engram(cfg, spec.index) if spec.engram else None
        self.hc_attn = mhc.HCSite(cfg.dim, cfg.mhc, cfg.norm_eps)
        self.hc_ffn = mhc.HCSite(cfg.dim, cfg.mhc, cfg.norm_eps)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = CSA2Attention(cfg, spec)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg.dim, cfg.moe, cfg.init_std, cfg.fp8_gemm)
        self.init_std = cfg.init_std
        self._resolve_kernel_path()

    def _kernel_device(self) -> torch.device:
        return self.attn_norm.weight.device

    def init_weights(self) -> None:
        if self.engram is not None:
            self.engram.init_weights()
        self.hc_attn.init_weights(self.init_std)
        self.hc_ffn.init_weights(self.init_std)
        self.attn_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attn.init_weights()
        self.ffn.init_weights()

    def forward(self, S, pre_prev, state: ForwardState, engram_in=None, image_mask=None):
        """S [B, T, n, dim] streams; pre_prev [B, T, n] (or [n]) the previous site's `pre`; state: what earlier
        blocks made (read only). Returns (S, pre) for the next block and this block's `LayerOutputs`."""
        if self.engram is not None:
            row_ids, dead = engram_in
            S = self.engram(S, row_ids, dead)
        ca = self.hc_attn(S)
        x = mhc.collapse(S, pre_prev)
        kv_in = None
        if self.spec.owns_kv and self.spec.kv_input == "h_mid":
            kv_in = self.attn_norm(state.h_mid)
        y, made = self.attn(self.attn_norm(x), state, kv_in)
        S, x, cf = kern.mhc_step(self.impl, y, S, ca, ca.pre, self.hc_ffn, self.kernel_path)
        experts = None if state.routing is None else state.routing.expert_rows(self.spec.index, state)
        y, made.expert_load, made.balance_loss = self.ffn(self.ffn_norm(x), image_mask, experts,
                                                          return_experts=state.keep_routing)
        if state.keep_routing:
            made.experts = self.ffn.chosen_experts
        S = mhc.expand(y, S, cf.post, cf.comb)
        return S, cf.pre, made
