"""Engram: a hashed n-gram memory read at the entry of its layer and gated into each mHC stream (REFERENCE A8).

Shape legend: B batch, T tokens, n mHC streams, D hidden width (dim), C sub-tables per layer (= num_orders *
num_heads), Dh table row width (head_dim), N table rows (sum of the layer's primes).

Contract: `Engram(S [B, T, n, D], row_ids [B, T, C], dead [B, T])` -> S': the rows the `EngramHasher` addressed for
the whole forward, projected to n keys and one value, gated per stream into S (no causal convolution). The table is
read only through `lookup`, so a parallel plan can install a `row_reader` (trainer/parallel/engram.py shards the
rows; the model sees no process group). `init_table_rows_` initialises any contiguous row range to the single
process's values without materialising the whole table.

Design and reasoning: docs/model.md#engram-memory
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.common import init_normal, local
from model import kernels as kern
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
# Rows per initialisation block (one generator each): 64 MB of fp32 values at the flagship's 256 columns.
_INIT_BLOCK_ROWS = 1 << 16
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive block indices over the seed space


@torch.no_grad()
def init_table_rows_(rows: torch.Tensor, first_row: int, std: float, seed: int) -> None:
    """Fill rows [N_local, Dh] (table rows first_row .. first_row + N_local - 1) with normal(0, std) values that
    depend only on (seed, row): block b of _INIT_BLOCK_ROWS rows is drawn in fp32 on the CPU from a generator
    seeded with (seed + b * _GOLDEN) mod 2^63, whatever device or dtype holds the rows."""
    num_local, dh = rows.shape
    gen = torch.Generator(device="cpu")
    end = first_row + num_local
    for b in range(first_row // _INIT_BLOCK_ROWS, -(-end // _INIT_BLOCK_ROWS)):
        gen.manual_seed((seed + b * _GOLDEN) % 2**63)
        block = torch.empty(_INIT_BLOCK_ROWS, dh).normal_(0.0, std, generator=gen)
        lo, hi = max(first_row, b * _INIT_BLOCK_ROWS), min(end, (b + 1) * _INIT_BLOCK_ROWS)
        rows[lo - first_row:hi - first_row].copy_(block[lo - b * _INIT_BLOCK_ROWS:hi - b * _INIT_BLOCK_ROWS])


class Engram(kern.KernelPath, nn.Module):
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
        self.kernels = cfg.kernels
        self.num_rows = engram_table_rows(ecfg, layer_id)
        # [N, Dh]; the 24 prime-sized sub-tables of this layer laid end to end (row ids carry the offsets).
        self.table = nn.Parameter(torch.empty(self.num_rows, self.head_dim, dtype=_DTYPES[ecfg.table_dtype]))
        # n keys (one per stream) and one shared value, from all C rows of the token.
        self.wkv = nn.Linear(self.num_columns * self.head_dim, (self.num_streams + 1) * self.dim, bias=False)
        # Used only as their product (A8); kept as two [n, D] tensors so checkpoints map one to one.
        self.q_weight = nn.Parameter(torch.empty(self.num_streams, self.dim))
        self.k_weight = nn.Parameter(torch.empty(self.num_streams, self.dim))
        # How `lookup` reads rows. None: this process holds the whole table. A plan installs a plain object (not a
        # module, so the state dict is unchanged) with `__call__(table, row_ids) -> rows` and `first_row` (the global
        # index of this process's first row, which `init_weights` needs).
        self.row_reader = None
        self._resolve_kernel_path()

    def _kernel_device(self) -> torch.device:
        return self.q_weight.device  # the compute device (the table may live in host memory)

    @torch.no_grad()
    def init_weights(self) -> None:
        # One draw advances the default generator by the same amount in every layout (and the wkv draw after it).
        seed = int(torch.randint(0, 2**62, ()))
        init_table_rows_(local(self.table), getattr(self.row_reader, "first_row", 0), self.init_std, seed)
        init_normal(self.wkv.weight, self.init_std)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] int64 -> rows [..., Dh] in the table dtype. Gradient lands only on the rows read."""
        if self.row_reader is not None:
            return self.row_reader(self.table, row_ids)
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
        if (self.kernel_path == "triton" and self.row_reader is None
                and kern.plain(S, self.table, self.wkv.weight)):
            # The Triton gather and fused gate (model/kernels.py). It reads the whole table by global row id, so a
            # sharded table (a row_reader) and a tensor-parallel plan's DTensors stay on this reference path.
            return kern.engram_forward(self, S, row_ids, dead)
        B, T, n, D = S.shape
        rows = self.lookup(row_ids)  # [B, T, C, Dh]
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [B, T, (n + 1) * D]
        key = kv[..., : n * D].unflatten(-1, (n, D))  # [B, T, n, D], stream-major as in the reference
        value = kv[..., n * D :]  # [B, T, D]
        g = self.gate(S, key, dead)  # [B, T, n]
        # The update is formed in fp32 and rounded once into the stream dtype.
        return (S.float() + g[..., None] * value.float()[:, :, None, :]).to(S.dtype)
