"""CSA2 attention for one layer: shared-KV (MQA) attention over the SWA window plus the selected compressed entries.

Contract: `CSA2Attention` computes one layer's attention (REFERENCE A2-A5): K = V (one latent shared by all heads),
a per-head sink in the softmax denominator only. Full layers build the main KV and indexer keys and return both;
Reuse/Reindex layers read them from their KV source's entry in the `ForwardState`; index sources (Full, Reindex)
return their top-k, Reuse layers read their source's. The indexer learns from a KL loss only (`indexer_kl`; its
inputs and target are detached, so the loss never reaches the backbone). A layer reads what earlier layers made
from the ForwardState and returns what it makes (`LayerOutputs`, model/forward.py), writing nothing that outlives
its call. With a cache in the state it runs serving's path (model/serving.py `cached_attention`, over the public
pieces `queries`, `index_queries`, `pick`). `attend` (model/csa2.py) is the reference attention; the Triton path
is model/kernels.py's.

Design and reasoning: docs/model.md#csa2-attention
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.fp8_gemm import fp8_blockdiag_linear
from model import kernels as kern
from model.common import RMSNorm, autocast_dtype, init_linear, linear, local
from model.config import ModelConfig
from model.csa2 import Compressor, Indexer, attend, candidate_pool, index_scores, select_topk, visible_mask
from model.forward import WHOLE, ForwardState, LayerOutputs
from model.fp8 import maybe_fp8_linear, use_fp8
from model.layer_plan import LayerSpec
from model.routing import forced_selection
from model.rope import apply_rope
from model.serving import cached_attention


class HeadSum(nn.Module):
    """[B, H, T, E] -> [B, T, E]: attention probabilities summed over heads (the indexer's KL target, unnormalised).

    A module of its own so that a tensor-parallel plan, which splits the heads, can complete the sum across ranks."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return p.sum(1)


def indexer_kl(attn_mass: torch.Tensor, scores: torch.Tensor, domain: torch.Tensor,
               chunk_mean: Callable[[torch.Tensor], torch.Tensor] = WHOLE.chunk_mean) -> torch.Tensor:
    """KL(attention || indexer) over the indexer's search domain, mean over query rows that have a target.

    attn_mass [B, T, E] fp32 attention probabilities over compressed entries summed over heads (`HeadSum`);
    scores [B, T, E] indexer scores; domain [B, T, E] bool. Under context parallelism (`SequenceShard.chunk_mean`)
    a chunk divides its rows' KL sum by the chunks' mean row count, so the mean over chunks is the mean over all
    rows; a chunk without rows still returns a zero that depends on `scores`, so every chunk runs the same backward
    (the key gather's reduce-scatter among it). No data-dependent shape or branch (torch.compile, CUDA graphs): rows
    without a target are masked, not selected, and a step without any gives an exact zero."""
    target = attn_mass.detach() * domain
    mass = target.sum(-1, keepdim=True)
    rows = mass.squeeze(-1) > 0
    num_rows = chunk_mean(rows.sum().float())
    target = target / mass.clamp_min(1e-30)
    logq = scores.masked_fill(~domain, float("-inf")).log_softmax(-1)
    kl = torch.special.xlogy(target, target) - torch.where(target > 0, target * logq, torch.zeros_like(logq))
    total = torch.where(rows, kl.sum(-1), 0.0).sum()
    return torch.where(num_rows > 0, total / num_rows.clamp_min(1.0), 0.0)


def head_rows(cfg) -> dict[str, int]:
    """The query and key projections' head layout, for head-wise optimisers (optim.rules headwise=true): parameter
    name suffix -> rows per head. The attention's query wq_b is [H * head_dim, q_lora] and its one shared KV head wkv
    [head_dim, D]; the indexer's query wq_b is [Hi * index_head_dim, q_lora] and its one key head wk
    [index_head_dim, latent]."""
    a, ix = cfg.attention, cfg.csa2
    return {"attn.wq_b.weight": a.head_dim, "attn.wkv.weight": a.head_dim,
            "indexer.wq_b.weight": ix.index_head_dim, "indexer.wk.weight": ix.index_head_dim}


class CSA2Attention(kern.KernelPath, nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        a, c = cfg.attention, cfg.csa2
        self.cfg, self.spec = cfg, spec
        self.kernels = cfg.kernels
        self.num_heads, self.head_dim = a.num_heads, a.head_dim
        eps = cfg.norm_eps
        fp8 = cfg.fp8_gemm  # FP8 GEMMs (model.fp8) where the dims are multiples of 128
        self.wq_a = maybe_fp8_linear(cfg.dim, a.q_lora_rank, fp8)
        self.q_norm = RMSNorm(a.q_lora_rank, eps)
        self.wq_b = maybe_fp8_linear(a.q_lora_rank, a.num_heads * a.head_dim, fp8)
        self.wkv = maybe_fp8_linear(cfg.dim, a.head_dim, fp8)
        self.kv_norm = RMSNorm(a.head_dim, eps)
        # block-diagonal output projection: group g (heads g*H/G ..) -> o_lora_rank, stored as one matrix
        self.wo_a = linear(a.num_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank)
        self.fp8_wo_a = use_fp8(fp8, a.num_heads * a.head_dim // a.o_groups, a.o_lora_rank)
        self.wo_b = maybe_fp8_linear(a.o_groups * a.o_lora_rank, cfg.dim, fp8)
        self.attn_sink = nn.Parameter(torch.empty(a.num_heads, dtype=torch.float32))
        self.compressor = Compressor(cfg.dim, a.head_dim, spec.ratio, eps) if spec.owns_kv else None
        self.indexer = (
            Indexer(cfg.dim, a.q_lora_rank, a.head_dim, c.index_num_heads, c.index_head_dim, spec.owns_kv, eps)
            if spec.owns_indexer else None
        )
        self.head_sum = HeadSum()
        self._resolve_kernel_path()

    def _kernel_device(self) -> torch.device:
        return self.wq_a.weight.device

    def init_weights(self) -> None:
        std = self.cfg.init_std
        for lin in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            init_linear(lin, std)
        self.q_norm.init_weights()
        self.kv_norm.init_weights()
        nn.init.zeros_(self.attn_sink)
        if self.compressor is not None:
            self.compressor.init_weights(std)
        if self.indexer is not None:
            self.indexer.init_weights(std)

    # -- pieces (queries, index_queries, pick and pick_kernels are public: serving runs them, model/serving.py) -------
    def _compress(self, kv_in: torch.Tensor, state: ForwardState, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Full layer: compress, rotate at each group's first token, fake-quantise; returns (main, index keys) of
        every chunk of the sequence."""
        a, q = self.cfg.attention, self.cfg.quant
        m = self.spec.ratio
        # The fused kernel applies the compressor's norm where it may read its weight (model/kernels.py); the
        # compressor then hands over the pre-norm latent, and the kernel returns the normed one next to the main KV.
        norm = self.compressor.norm if kern.fuses_norm(self.compressor.norm, path) else None
        latent = self.compressor(kv_in, norm=norm is None)  # [B, E, D] (this chunk's groups under context parallelism)
        E = latent.shape[1]
        pos = (torch.arange(E, device=latent.device) + state.offset // m) * m  # each group's first token
        cos, sin = state.rope(a, "compress", pos, latent.dtype, key=("entries", m))
        main, latent = kern.norm_rope_quant(latent, norm, cos, sin, "fp4" if q.main_kv == "fp4" else None, path,
                                            return_normed=True)  # latent: normed, pre-RoPE, detached
        # k_norm is a module of its own (a tensor-parallel plan hooks it): the composed path calls it
        keys = kern.norm_rope_quant(self.indexer.keys(latent, norm=False), self.indexer.k_norm, cos, sin,
                                    "fp4_ue8m0" if q.index == "fp4" else None, path)
        # Context parallelism: chunks align with groups, so each compresses its own and all exchange the entries.
        main, keys = state.shard.gather_entries(main, keys)
        # (the emptiness test first: a compiled block then guards on an empty dict, not on its own layer index, so
        # blocks of one role share a graph)
        if state.kv_fixed and self.spec.index in state.kv_fixed:  # bounded-replay simulation: the prefix's cached entries stay
            fixed_main, fixed_keys, n = state.kv_fixed[self.spec.index]
            keep = (torch.arange(main.shape[1], device=main.device)[None] < n[:, None])[..., None]
            main, keys = torch.where(keep, fixed_main, main), torch.where(keep, fixed_keys, keys)
        return main, keys

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_res [B, T, q_lora] the low-rank query state, q [B, T, H, D] rotated; H/tp under tp)."""
        q_res = self.q_norm(self.wq_a(x))
        return q_res, apply_rope(self.wq_b(q_res).unflatten(-1, (-1, self.head_dim)), cos, sin)

    def index_queries(self, x, q_res, state: ForwardState, path: str):
        """Index source: the indexer's queries (RoPE, fake-quant) [B, T, Hi, Di] and head weights [B, T, Hi], from
        detached inputs (the indexer learns from its KL alone)."""
        a, q = self.cfg.attention, self.cfg.quant
        qi = self.indexer.queries(q_res.detach())
        cos, sin = state.rope(a, "compress", state.positions, qi.dtype)
        qi = kern.norm_rope_quant(qi, None, cos, sin, "fp4_ue8m0" if q.index == "fp4" else None, path)
        if self.spec.uses_pool and state.pool is None:
            raise RuntimeError(f"layer {self.spec.index}: Reindex layer found no candidate pool in the forward state")
        return qi, self.indexer.head_weights(x.detach())

    def _select(self, x, q_res, keys, E, state: ForwardState, path: str):
        """Index source: score visible entries (in the pool, if restricted) and pick the top-k. Returns (scores,
        domain, top-k, pool or None: what a pool builder makes). path: the kernel switch (on "triton",
        `pick_kernels` says what it returns). Top-k and pool carry no gradient."""
        qi, w = self.index_queries(x, q_res, state, path)
        if path == "triton":
            return self.pick_kernels(qi, w, keys, E, state)
        B, T = x.shape[:2]
        return self.pick(qi, w, keys, visible_mask(T, E, self.spec.ratio, x.device, state.offset).expand(B, T, E),
                          state)

    def pick(self, qi, w, keys, visible: torch.Tensor, state: ForwardState):
        """The reference path's scoring and choice, shared with serving (model/serving.py): visible [B, T, E] the
        entries each query may see. Returns (scores [B, T, E], domain, top-k [B, T, E] bool, pool or None). A
        recorded top-k (state.routing, RL's index replay) replaces the chosen one for the rows it covers."""
        c, spec = self.cfg.csa2, self.spec
        domain = visible & state.pool if spec.uses_pool else visible
        scores = index_scores(qi, w, keys)
        masked = scores.masked_fill(~domain, float("-inf"))
        pool = None
        if spec.builds_pool:
            pool = candidate_pool(masked.detach(), spec.ratio, c.candidate_block_size, c.candidate_topk_blocks,
                                  positions=state.positions.expand(*masked.shape[:2]))
        with torch.no_grad():
            selection = forced_selection(state, spec.index, select_topk(masked, c.index_topk))
        return scores, domain, selection, pool

    def pick_kernels(self, qi, w, keys, E, state: ForwardState):
        """`_select` on the indexer kernels (serving's prefill on the kernels runs it too, model/serving.py), for the
        queries at positions state.offset + t. Returns (scores, pos, top-k, pool): scores [B, T, E] (dense) or
        [B, T, S] (the pool's slots, in a pool-restricted layer), -inf outside the search domain; pos [B, T, K]
        int32, the top-k's positions in scores' last dim (-1 = empty); the top-k as entry ids; the pool as block
        ids (a pool builder; None otherwise)."""
        c, spec = self.cfg.csa2, self.spec
        bs = c.candidate_block_size
        if E == 0:  # no group complete yet: nothing to score, an empty top-k (and pool)
            pos = torch.full((*qi.shape[:2], 0), -1, dtype=torch.int32, device=qi.device)
            return w.new_zeros(*qi.shape[:2], 0), pos, pos, pos if spec.builds_pool else None
        pool = None
        if spec.uses_pool:
            scores = kern.index_scores_pool(qi, w, keys, state.pool, spec.ratio, bs, state.offset)
        else:
            scores = kern.index_scores(qi, w, keys, spec.ratio, state.offset)
            if spec.builds_pool:
                pool = kern.candidate_pool(scores.detach(), spec.ratio, bs, c.candidate_topk_blocks, state.offset)
        # pos is recomputed: the KL gathers the scores at it (a saved index)
        pos = kern.select_topk(scores.detach(), c.index_topk)
        selection = kern.slot_entries(pos, state.pool, bs) if spec.uses_pool else pos
        return scores, pos, selection, pool

    # -- forward -----------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, state: ForwardState,
                kv_in: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerOutputs]:
        """x [B, T, dim] normalised attention input; kv_in: the compressor input of a Full layer (x in the encoder,
        the layer's norm of h_{L/2} in the decoder). Returns ([B, T, dim], what this layer made: its KV, top-k,
        pool and indexer KL, as its role has them)."""
        if state.cache is not None:  # serving: attention over the inference cache, filling it (model/serving.py)
            out, cos, sin, made = cached_attention(self, x, state, kv_in)
            return self._project_out(out, cos, sin), made
        a, qc = self.cfg.attention, self.cfg.quant
        spec = self.spec
        B, T, _ = x.shape
        kind = spec.rope
        path = self.kernel_path
        if state.routing is not None or state.keep_routing or state.window_floor:
            # recorded top-k and truncated windows are the reference path's masks; every layer takes it, so a Reuse
            # layer reads its index source's top-k in the form it makes
            path = "reference"
        made = LayerOutputs()
        cos, sin = state.rope(a, kind, state.positions, x.dtype)

        q_res, q = self.queries(x, cos, sin)
        kv = kern.norm_rope_quant(self.wkv(x), self.kv_norm, cos, sin, "fp8" if qc.swa_kv == "fp8" else None, path)
        # Window keys: under context parallelism the previous chunk's last rows come first (a halo of h rows).
        kv_keys = state.shard.window_halo(kv)  # [B, h + T, D]
        h = kv_keys.shape[1] - T

        kv_cmp = cmp_mask = scores = domain = None
        if spec.ratio > 0:
            if spec.owns_kv:
                made.kv = self._compress(kv_in if kv_in is not None else x, state, path)
            kv_cmp, keys = made.kv if spec.owns_kv else state.kv[spec.kv_source]
            E = kv_cmp.shape[1]
            if spec.owns_indexer:
                scores, domain, made.selection, made.pool = self._select(x, q_res, keys, E, state, path)
            if state.phase == "dense_warmup":
                cmp_mask = visible_mask(T, E, spec.ratio, x.device, state.offset).expand(B, T, E)
            else:
                cmp_mask = made.selection if spec.owns_indexer else state.selection[spec.index_source]
            if E == 0:
                kv_cmp = None

        sink = local(self.attn_sink)
        if path == "triton" and (state.phase == "sparse" or kv_cmp is None):
            # Window + top-k ids (cmp_mask is [B, T, K] int32 here). For an index source the kernel also returns
            # the KL target on the sparse phase's domain, the top-k itself: each slot's probability summed over heads.
            # Under context parallelism the halo rows that hold tokens (none before token 0) lead the window keys.
            lead = min(h, state.offset)
            out, p_top = kern.sparse_attention(q, kv_keys[:, h - lead:], kv_cmp, cmp_mask, sink, a.window,
                                               topk_probs=scores is not None, lead=lead)
            if p_top is not None:
                # `domain` holds the top-k's positions in scores; HeadSum sums a unit head axis (the kernel summed
                # the heads) and stays the hook a tensor-parallel plan completes the sum at
                made.indexer_kl = indexer_kl(self.head_sum(p_top[:, None]),
                                             scores.gather(-1, domain.clamp_min(0).long()), domain >= 0,
                                             state.shard.chunk_mean)
        else:
            p = state.positions
            k_pos = torch.cat((torch.arange(-h, 0, device=p.device) + p[0], p))  # [h + T]; < 0: no token (1st chunk)
            win_mask = (k_pos[None, :] <= p[:, None]) & (k_pos[None, :] > p[:, None] - a.window) & (k_pos >= 0)[None]
            if state.window_floor and spec.index in state.window_floor:  # (emptiness first: see kv_fixed)
                # bounded-replay simulation: a replayed query's window starts at its replayed span
                win_mask = win_mask & (k_pos[None, None, :] >= state.window_floor[spec.index][..., None])
            out, p_cmp = attend(q, kv_keys, kv_cmp, win_mask, cmp_mask, sink)
            if scores is not None and p_cmp is not None:
                mass = self.head_sum(p_cmp.detach())  # [B, T, E]
                if path == "triton":
                    # dense warm-up on the indexer kernels' scores: -inf marks the domain (visible, in the pool)
                    if spec.uses_pool:
                        slots = kern.pool_entries(state.pool, self.cfg.csa2.candidate_block_size)
                        mass = mass.gather(-1, slots.clamp(0, E - 1))  # [B, T, S]
                    domain = scores > float("-inf")
                elif state.phase == "sparse":
                    domain = domain & cmp_mask
                made.indexer_kl = indexer_kl(mass, scores, domain, state.shard.chunk_mean)

        return self._project_out(out, cos, sin), made

    def _project_out(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] attention output -> [B, T, dim]: inverse RoPE at the query position, grouped wo_a, wo_b."""
        out = apply_rope(out, cos, sin, inverse=True)  # [B, T, H, D]
        w = local(self.wo_a.weight).unflatten(0, (-1, self.cfg.attention.o_lora_rank))  # [G, o_lora_rank, H / G * D]
        if self.fp8_wo_a:  # one block-diagonal FP8 GEMM: the 1 x 128 blocks of a row never straddle two groups
            dtype = autocast_dtype(out.device.type) or out.dtype
            return self.wo_b(fp8_blockdiag_linear(out.flatten(2).to(dtype), w))
        grouped = out.flatten(2).unflatten(-1, (w.shape[0], -1))  # [B, T, G, H / G * D]: groups are head blocks
        y = torch.einsum("btgi,goi->btgo", grouped, w).flatten(2)
        return self.wo_b(y)
