"""The V4.1 text backbone: embedding -> 40 mHC blocks (CED: 20 encoder + 20 decoder) -> norm -> head.

Shape legend: B batch, T tokens, n mHC streams, dim hidden width, V vocabulary.

Block order (REFERENCE A6 "The lag"): Engram (if any) updates the streams first; the attention site predicts its
coefficients from the streams and the attention reads the streams collapsed with the PREVIOUS site's `pre`; the FFN
site predicts its coefficients from the updated streams and the FFN reads them collapsed with the attention site's
`pre`. That lag is what lets residual update, input mixing and coefficient prediction run as one pass (model/mhc.py).

CED: the collapsed output of the last encoder layer is h_{L/2}; decoder Full layers compress their global KV from
their own norm of it, never from their own stream. It travels in the ForwardContext (and across pipeline stages).
"""

from __future__ import annotations

import torch
from torch import nn

from model import kernels as kern
from model import mhc
from model.attention import CSA2Attention, ForwardContext, SequenceShard
from model.common import RMSNorm, init_normal
from model.config import ModelConfig
from model.engram import Engram, EngramHasher
from model.layer_plan import LayerSpec, build_layer_plan
from model.moe import MoE


class Block(nn.Module):
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
        self.ffn = MoE(cfg.dim, cfg.moe, cfg.init_std)
        self.init_std = cfg.init_std

    def init_weights(self) -> None:
        if self.engram is not None:
            self.engram.init_weights()
        self.hc_attn.init_weights(self.init_std)
        self.hc_ffn.init_weights(self.init_std)
        self.attn_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attn.init_weights()
        self.ffn.init_weights()

    def forward(self, S, pre_prev, ctx: ForwardContext, engram_in=None, image_mask=None):
        """S [B, T, n, dim] streams; pre_prev [B, T, n] (or [n]) the previous site's `pre`.
        Returns (S, pre) for the next block."""
        if self.engram is not None:
            row_ids, dead = engram_in
            S = self.engram(S, row_ids, dead)
        ca = self.hc_attn(S)
        x = mhc.collapse(S, pre_prev)
        kv_in = None
        if self.spec.owns_kv and self.spec.kv_input == "h_mid":
            kv_in = self.attn_norm(ctx.h_mid)
        y = self.attn(self.attn_norm(x), ctx, kv_in)
        S, x, cf = mhc.mhc_step(self.impl, y, S, ca, ca.pre, self.hc_ffn, kern.resolve(self.kernels, S.device))
        y = self.ffn(self.ffn_norm(x), image_mask)
        S = mhc.expand(y, S, cf.post, cf.comb)
        return S, cf.pre


# The pieces of the forward (context, embedding, blocks, head), shared by `Transformer.forward` and the pipeline
# stages (trainer/parallel/pipeline.py), so a stage computes exactly what the same layers compute in the whole model.


def new_context(cfg: ModelConfig, input_ids: torch.Tensor, shard: SequenceShard, hasher: EngramHasher | None = None,
                image_mask: torch.Tensor | None = None) -> tuple[ForwardContext, dict | None]:
    """The ForwardContext of one forward on input_ids [B, T], and the Engram row ids of its tokens ({layer: (row_ids
    [B, T, C], dead [B, T])}, None without Engram). Under context parallelism input_ids is this process's chunk:
    positions start at shard.index * T, and since an n-gram reaches back max_ngram - 1 tokens, possibly into the
    previous chunk, the ids are hashed on the whole sequence (`shard.gather_tokens`: ids are cheap), then sliced."""
    T = input_ids.shape[1]
    offset = shard.index * T
    ctx = ForwardContext(positions=torch.arange(T, device=input_ids.device) + offset, phase=cfg.indexer.phase,
                         offset=offset, shard=shard)
    if hasher is None:
        return ctx, None
    image_mask = None if image_mask is None else shard.gather_tokens(image_mask)
    rows = hasher.for_tokens(shard.gather_tokens(input_ids), image_mask)
    mine = slice(offset, offset + T)
    return ctx, {layer: (row_ids[:, mine], dead[:, mine]) for layer, (row_ids, dead) in rows.items()}


def embed_streams(embed: nn.Embedding, input_ids: torch.Tensor, num_streams: int):
    """input_ids [B, T] -> (S [B, T, n, dim] every stream the embedding, pre [n] the first site's one-hot `pre`)."""
    h = embed(input_ids)
    return mhc.init_streams(h, num_streams), mhc.first_pre(num_streams, device=h.device)


def forward_blocks(blocks, S, pre, ctx: ForwardContext, num_encoder_layers: int, engram_in=None, image_mask=None):
    """Run consecutive blocks (any contiguous slice of the layers) on (S, pre); returns (S, pre) after the last.

    h_{L/2} is collapsed on entry to the first decoder layer (index num_encoder_layers) when that layer is in the
    slice; a slice that starts later reads it from ctx.h_mid, as do the KV, top-k and pool its layers reuse.
    engram_in: {layer index: (row_ids, dead)} for the Engram layers of the slice."""
    for layer in blocks:
        if layer.spec.index == num_encoder_layers:
            ctx.h_mid = mhc.collapse(S, pre)
        e_in = engram_in[layer.spec.index] if layer.engram is not None else None
        S, pre = layer(S, pre, ctx, e_in, image_mask)
    return S, pre


def head_logits(norm: RMSNorm, head: nn.Linear, S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse with the last layer's `pre`, norm, head: logits [B, T, V] in fp32."""
    return head(norm(mhc.collapse(S, pre))).float()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.plan = build_layer_plan(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, spec) for spec in self.plan)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.hasher = EngramHasher(cfg) if cfg.engram.layers else None
        # Where this process's tokens sit in each sequence and the hooks reaching the rest: the whole sequence by
        # default; context parallelism (trainer/parallel/context.py) installs its own. A plain object, no state.
        self.sequence_shard = SequenceShard()

    # -- set-up --------------------------------------------------------------------------------------------------------
    def init_weights(self) -> None:
        init_normal(self.embed.weight, self.cfg.init_std)
        init_normal(self.head.weight, self.cfg.init_std)
        self.norm.init_weights()
        for layer in self.layers:
            layer.init_weights()
        if self.hasher is not None:
            self.hasher.init_buffers()

    def indexer_parameters(self):
        for layer in self.layers:
            if layer.attn.indexer is not None:
                yield from layer.attn.indexer.parameters()

    def trainable_parameters(self):
        """Parameters the optimiser owns: all that learn, or only the indexers in the dense warm-up phase."""
        if self.cfg.indexer.phase == "dense_warmup":
            return list(self.indexer_parameters())
        return [p for p in self.parameters() if p.requires_grad]

    def flops_per_token(self, seq_len: int) -> float:
        """Useful training FLOPs per token (forward + backward), for MFU; see model/accounting.py."""
        from model.accounting import train_flops_per_token

        return train_flops_per_token(self, seq_len)

    def set_canonical_vocab(self, canonical_map: torch.Tensor) -> None:
        """Install a tokenizer's canonical vocabulary for Engram hashing (model.engram.canonical_vocab_from_tokenizer)."""
        if self.hasher is not None:
            self.hasher.set_canonical_map(canonical_map)

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]

    @torch.no_grad()
    def update_router_biases(self, counts: list[torch.Tensor] | None = None) -> float:
        """Aux-loss-free balancing after an optimiser step; `counts` (per layer, e.g. all-reduced across ranks)
        override the local loads. Returns the worst max/mean expert-load ratio seen since the last update."""
        worst = 0.0
        for i, moe in enumerate(self.moe_layers()):
            worst = max(worst, float(moe.imbalance()))
            moe.update_bias(counts=None if counts is None else counts[i])
        return worst

    # -- forward -------------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, *, image_mask: torch.Tensor | None = None, return_aux: bool = False):
        """input_ids [B, T] -> logits [B, T, V] (fp32); with return_aux, (logits, aux) where aux holds the weighted
        auxiliary losses to add to the LM loss and aux["metrics"] their unweighted values."""
        cfg = self.cfg
        ctx, engram_in = new_context(cfg, input_ids, self.sequence_shard, self.hasher, image_mask)
        S, pre = embed_streams(self.embed, input_ids, cfg.mhc.num_streams)
        S, pre = forward_blocks(self.layers, S, pre, ctx, cfg.num_encoder_layers, engram_in, image_mask)
        logits = head_logits(self.norm, self.head, S, pre)
        if not return_aux:
            return logits
        return logits, self._aux(ctx)

    def _aux(self, ctx: ForwardContext) -> dict:
        metrics: dict[str, float] = {}
        aux: dict = {}
        if ctx.indexer_kl:
            kl = torch.stack(list(ctx.indexer_kl.values())).mean()
            aux["indexer_kl"] = self.cfg.indexer.loss_coef * kl
            metrics["indexer_kl"] = float(kl.detach())
        seq = [m.aux_loss for m in self.moe_layers() if getattr(m, "aux_loss", None) is not None]
        if seq:
            total = torch.stack([s for s in seq]).sum()
            aux["moe_seq_balance"] = total
            metrics["moe_seq_balance"] = float(total.detach())
        aux["metrics"] = metrics
        return aux
