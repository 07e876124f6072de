"""Engram: a hashed n-gram memory read at the entry of its layer and gated into each mHC stream (REFERENCE A8).

Shape legend: B batch, T tokens, n mHC streams, D hidden width (dim), C sub-tables per layer (= num_orders * num_heads),
Dh table row width (head_dim), N table rows (sum of the layer's primes).

One module per Engram layer. Its input is the row ids the `EngramHasher` computed once for the whole forward (the
addresses depend only on token ids, so they are known before layer 0 runs and the rows can be prefetched):
  rows [B, T, C, Dh] -> flatten -> wkv -> n keys [B, T, n, D] (stream-major) and one value [B, T, D];
  per stream k, a context-aware scalar gate g_k from the stream and its key; S_k += g_k * value.
There is no short causal convolution (SPEC 1.6).

The table is read only through `lookup`, so a sharded or host-resident table can replace it without touching the
gate (REFERENCE B5: serving shards it by hash head or keeps it in pinned host memory).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.engram_hash import (
    EngramHasher,
    build_canonical_vocab,
    canonical_vocab_from_tokenizer,
    engram_multipliers,
    engram_primes,
    engram_table_rows,
)

__all__ = [
    "Engram",
    "EngramHasher",
    "build_canonical_vocab",
    "canonical_vocab_from_tokenizer",
    "engram_multipliers",
    "engram_primes",
    "engram_table_rows",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Engram(nn.Module):
    """The Engram of model layer `layer_id`. forward(S [B, T, n, D], row_ids [B, T, C], dead [B, T]) -> S'."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        ecfg = cfg.engram
        if layer_id not in ecfg.layers:
            raise ValueError(f"layer {layer_id} is not in model.engram.layers={list(ecfg.layers)}")
        self.layer_id = layer_id
        self.dim = cfg.dim
        self.num_streams = cfg.mhc.num_streams
        self.num_columns = (ecfg.max_ngram - 1) * ecfg.num_heads
        self.head_dim = ecfg.head_dim
        self.eps = cfg.norm_eps
        self.init_std = cfg.init_std
        self.num_rows = engram_table_rows(ecfg, layer_id)
        # [N, Dh]; the 24 prime-sized sub-tables of this layer laid end to end (row ids carry the offsets).
        self.table = nn.Parameter(torch.empty(self.num_rows, self.head_dim, dtype=_DTYPES[ecfg.table_dtype]))
        # n keys (one per stream) and one shared value, from all C rows of the token.
        self.wkv = nn.Linear(self.num_columns * self.head_dim, (self.num_streams + 1) * self.dim, bias=False)
        # Used only as their product (A8); kept as two [n, D] tensors so checkpoints map one to one.
        self.q_weight = nn.Parameter(torch.empty(self.num_streams, self.dim))
        self.k_weight = nn.Parameter(torch.empty(self.num_streams, self.dim))

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.table, mean=0.0, std=self.init_std)
        nn.init.normal_(self.wkv.weight, mean=0.0, std=self.init_std)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] int64 -> rows [..., Dh] in the table dtype. Gradient lands only on the rows read."""
        return F.embedding(row_ids, self.table)

    def gate(self, S: torch.Tensor, key: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        """S, key [B, T, n, D] -> g [B, T, n] fp32 (REFERENCE A8 "Gate"); 0 for dead tokens."""
        h = S.float()
        k = key.float()
        qk = (self.q_weight.float() * self.k_weight.float())  # [n, D]
        dot = (h * qk * k).sum(-1)  # [B, T, n]
        # Both sides RMS-normalised without weights, then / sqrt(D): a cosine-like score on a fixed scale.
        dot = dot * torch.rsqrt(h.pow(2).mean(-1) + self.eps) * torch.rsqrt(k.pow(2).mean(-1) + self.eps)
        dot = dot / math.sqrt(self.dim)
        # Signed square root: compresses large scores so the sigmoid does not saturate; the floor keeps the
        # derivative of sqrt finite at 0.
        g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        if dead is not None:
            # Padding and image tokens read no memory (B5); masking here also stops their gradient into the table.
            g = g.masked_fill(dead[..., None], 0.0)
        return g

    def forward(self, S: torch.Tensor, row_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """S [B, T, n, D] streams, row_ids [B, T, C] int64, dead [B, T] bool -> S' [B, T, n, D] (S's dtype)."""
        B, T, n, D = S.shape
        rows = self.lookup(row_ids)  # [B, T, C, Dh]
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [B, T, (n + 1) * D]
        key = kv[..., : n * D].unflatten(-1, (n, D))  # [B, T, n, D], stream-major as in the reference
        value = kv[..., n * D :]  # [B, T, D]
        g = self.gate(S, key, dead)  # [B, T, n]
        # The update is formed in fp32 and rounded once into the stream dtype.
        return (S.float() + g[..., None] * value.float()[:, :, None, :]).to(S.dtype)
