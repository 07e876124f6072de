"""DSpark, the speculative-decoding drafter (SPEC 1.6, REFERENCE B6): `model.dspark.num_layers` SWA blocks that
draft a block of `block_size` tokens in one forward, fed from the frozen backbone's hidden states.

Shape legend: B sequences, A anchors per sequence, K block_size, W the drafter's context window, n mHC streams, dim
hidden width, V vocabulary, r the Markov head's rank, L the number of target layers.

Contract: `DSpark(cfg)` (built from `drafter_config(cfg)`) reads the backbone's residuals at `target_layers`
(`stream_means`), drafts a block per anchor (the anchor and K - 1 noise tokens, attending to the context
[a - W, a - 1] and to its own block) and returns `DraftOutput`: per slot the logits through the backbone's shared,
frozen head plus the Markov head, and the confidence that the draft survives verification. `draft_loss` /
`DraftLoss` train it; `acceptance_length` measures it. Its state dict is the drafter's own weights only.

Design and reasoning: docs/model.md#the-dspark-drafter
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from model import kernels as kern
from model import mhc
from model.block import Block
from model.common import RMSNorm, init_linear, init_normal, linear, local
from model.config import ModelConfig
from model.csa2 import attend
from model.layer_plan import LayerSpec
from model.moe import MoE
from model.rope import rope_tables

__all__ = ["DSpark", "DraftOutput", "drafter_config", "stream_means", "acceptance_length"]


def drafter_config(cfg: ModelConfig) -> ModelConfig:
    """The model config the draft blocks are built from: the backbone's, with the drafter's MoE size."""
    d = cfg.dspark
    if not d.target_layers:
        raise ValueError(f"model {cfg.name}: model.dspark.target_layers is empty, so it has no drafter")
    if any(not 0 <= i < cfg.num_layers for i in d.target_layers) or len(set(d.target_layers)) != len(d.target_layers):
        raise ValueError(f"model.dspark.target_layers={list(d.target_layers)}: distinct layers in [0, "
                         f"{cfg.num_layers})")
    if d.window > cfg.attention.window:
        raise ValueError(f"model.dspark.window={d.window} exceeds model.attention.window={cfg.attention.window}")
    if not 0 <= d.noise_token < cfg.vocab_size:
        raise ValueError(f"model.dspark.noise_token={d.noise_token} is not an id of the vocabulary ({cfg.vocab_size})")
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=d.num_experts,
                                                            experts_per_token=d.experts_per_token))


@contextmanager
def stream_means(backbone: nn.Module, layers):
    """Within the block, every forward of `backbone` (a Transformer) writes into the yielded dict {layer: [B, T, dim]}
    the residual entering each of `layers`, averaged over its mHC streams (forward pre-hooks on those blocks)."""
    found: dict[int, torch.Tensor] = {}
    handles = []
    for i in layers:
        def hook(module, args, i=i):
            found[i] = args[0].float().mean(dim=-2).to(args[0].dtype)  # S [B, T, n, dim] -> [B, T, dim]
        handles.append(backbone.layers[i].register_forward_pre_hook(hook))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


class DraftBlock(Block):
    """One draft block: a backbone block's sites and modules (SWA only, no Engram), its attention over the context
    and the block."""

    fsdp_forward_methods = ("context_kv",)  # under FSDP2 (trainer/parallel/apply.py) it gathers the block's weights

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, LayerSpec(index=index, is_decoder=True, role="swa", ratio=0, kv_source=None,
                                        index_source=None, builds_pool=False, uses_pool=False, engram=False,
                                        rope="main"))
        self.cfg = cfg

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """main_x [..., T, dim] at `positions` [..., T] -> this block's context KV [..., T, D] (rotated, quantised
        as the backbone's window KV)."""
        cos, sin = rope_tables(self.cfg.attention, "main", positions, main_x.dtype)
        quant = "fp8" if self.cfg.quant.swa_kv == "fp8" else None
        return kern.norm_rope_quant(self.attn.wkv(main_x), self.attn.kv_norm, cos, sin, quant, "reference")

    def forward(self, S, pre_prev, positions, ctx_kv, ctx_visible):
        """S [N, K, n, dim] the block's streams; pre_prev the previous site's `pre`; positions [N, K]; ctx_kv [N, W, D]
        the context KV each block sees, ctx_visible [N, W] which of it exists. Returns (S, pre, load [2, E]: the MoE's
        expert loads)."""
        attn = self.attn
        ca = self.hc_attn(S)
        x = self.attn_norm(mhc.collapse(S, pre_prev))  # [N, K, dim]
        cos, sin = rope_tables(self.cfg.attention, "main", positions, x.dtype)
        _, q = attn.queries(x, cos, sin)  # [N, K, H, D]
        quant = "fp8" if self.cfg.quant.swa_kv == "fp8" else None
        kv_block = kern.norm_rope_quant(attn.wkv(x), attn.kv_norm, cos, sin, quant, "reference")  # [N, K, D]
        keys = torch.cat((ctx_kv.to(kv_block.dtype), kv_block), dim=1)  # [N, W + K, D]
        N, K = positions.shape
        visible = torch.cat((ctx_visible[:, None, :].expand(N, K, -1),
                             torch.ones(N, K, K, dtype=torch.bool, device=x.device)), dim=-1)  # [N, K, W + K]
        out, _ = attend(q, keys, None, visible, None, local(attn.attn_sink))
        y = attn._project_out(out, cos, sin)
        S, x, cf = kern.mhc_step(self.impl, y, S, ca, ca.pre, self.hc_ffn, self.kernel_path)
        y, load, _ = self.ffn(self.ffn_norm(x))
        return mhc.expand(y, S, cf.post, cf.comb), cf.pre, load


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [B, A, K, V] fp32: the Markov-corrected draft logits
    confidence: torch.Tensor  # [B, A, K] fp32 logits of the confidence head (sigmoid: P(draft k survives))
    hidden: torch.Tensor  # [B, A, K, dim] the blocks' final hidden states (after the drafter's norm)


class DSpark(nn.Module):
    """The drafter of `cfg` (a backbone ModelConfig whose `dspark` section is set)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.dspark
        self.cfg, self.dcfg = cfg, drafter_config(cfg)
        self.main_proj = linear(len(d.target_layers) * cfg.dim, cfg.dim)
        self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.layers = nn.ModuleList(DraftBlock(self.dcfg, cfg.num_layers + i) for i in range(d.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.markov_in = nn.Embedding(cfg.vocab_size, d.markov_rank)  # W1
        self.markov_out = linear(d.markov_rank, cfg.vocab_size)  # W2
        self.confidence = nn.Linear(cfg.dim + d.markov_rank, 1)

    def init_weights(self) -> None:
        for _, _, init, _ in self.init_pieces():
            init()

    def init_pieces(self) -> list[tuple[int, nn.Module, object, bool]]:
        """(piece id, module, its init, is a block) for the trainer's piecewise materialisation
        (trainer/parallel/apply.py): every part initialised from its own seed, so any layout draws the values one
        process draws; the blocks are FSDP units. Ids: 0-5 the parts around the blocks, 6 + i draft block i."""
        std = self.cfg.init_std

        def confidence():
            init_linear(self.confidence, std)
            nn.init.zeros_(self.confidence.bias)

        return [(0, self.main_proj, lambda: init_linear(self.main_proj, std), False),
                (1, self.main_norm, self.main_norm.init_weights, False),
                (2, self.norm, self.norm.init_weights, False),
                (3, self.markov_in, lambda: init_normal(self.markov_in.weight, std), False),
                (4, self.markov_out, lambda: nn.init.zeros_(self.markov_out.weight), False),
                (5, self.confidence, confidence, False),
                *[(6 + i, layer, layer.init_weights, True) for i, layer in enumerate(self.layers)]]

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]

    def context(self, means: dict[int, torch.Tensor]) -> torch.Tensor:
        """{target layer: [B, T, dim]} (`stream_means`) -> main_x [B, T, dim]."""
        cat = torch.cat([means[i] for i in self.cfg.dspark.target_layers], dim=-1)
        return self.main_norm(self.main_proj(cat))

    def forward(self, embed: nn.Module, head: nn.Module, main_x: torch.Tensor | dict[int, torch.Tensor],
                anchors: torch.Tensor, anchor_tokens: torch.Tensor, prev_tokens: torch.Tensor) -> DraftOutput:
        """main_x [B, T, dim] the context (`context`) at positions 0..T-1, or the stream means it is computed from
        ({layer: [B, T, dim]}, `stream_means`: so a trainer wrapping the drafter computes it inside the forward);
        anchors [B, A] the anchors' positions; anchor_tokens [B, A] their tokens; prev_tokens [B, A, K] the token
        before each slot's target (the anchor, then the ground truth or the drafts). embed, head: the backbone's.
        Returns the block's `DraftOutput`."""
        if isinstance(main_x, dict):
            main_x = self.context(main_x)
        B, A = anchors.shape
        W = self.cfg.dspark.window
        ctx_pos = anchors[..., None] - W + torch.arange(W, device=anchors.device)  # [B, A, W]: a - W .. a - 1
        gather = ctx_pos.clamp_min(0).flatten(1)  # [B, A * W]
        all_pos = torch.arange(main_x.shape[1], device=main_x.device)

        def context_kv(layer):  # every position once, then each anchor's window: [N, W, D], N = B * A
            kv = layer.context_kv(main_x, all_pos)  # [B, T, D]
            return kv.gather(1, gather[..., None].expand(-1, -1, kv.shape[-1])).unflatten(1, (A, W)).flatten(0, 1)

        h = self._blocks(embed, anchors.flatten(), anchor_tokens.flatten(), context_kv,
                         (ctx_pos >= 0).flatten(0, 1))  # [N, K, dim]
        logits, confidence = self.heads(head, h, prev_tokens.flatten(0, 1))
        return DraftOutput(logits.unflatten(0, (B, A)), confidence.unflatten(0, (B, A)), h.unflatten(0, (B, A)))

    def _blocks(self, embed: nn.Module, anchors: torch.Tensor, anchor_tokens: torch.Tensor, context_kv,
                ctx_visible: torch.Tensor) -> torch.Tensor:
        """The draft blocks over N blocks: anchors, anchor_tokens [N]; context_kv(layer) -> [N, W, D] the context KV
        each block sees in that layer, ctx_visible [N, W] which of it exists. Returns the final hidden states
        [N, K, dim] (after the drafter's norm). In training mode the MoE loads go to the balancing counters."""
        d = self.cfg.dspark
        K = d.block_size
        positions = anchors[:, None] + torch.arange(K, device=anchors.device)  # [N, K]
        noise = torch.full((len(anchors), K - 1), d.noise_token, dtype=anchor_tokens.dtype,
                           device=anchor_tokens.device)
        tokens = torch.cat((anchor_tokens[:, None], noise), dim=-1)  # [N, K]
        S = mhc.init_streams(embed(tokens), self.cfg.mhc.num_streams)  # [N, K, n, dim]
        pre = mhc.first_pre(self.cfg.mhc.num_streams, device=S.device)
        for layer in self.layers:
            S, pre, load = layer(S, pre, positions, context_kv(layer), ctx_visible)
            if self.training:  # the balancing counters of the drafter's own MoE (trainer RouterBalance reads them)
                layer.ffn.add_load(load)
        return self.norm(mhc.collapse(S, pre))

    # -- inference (trainer/engine/spec_decode.py): the blocks once, then the heads slot by slot --------------------
    def draft_hidden(self, embed: nn.Module, ctx: torch.Tensor, ctx_visible: torch.Tensor, anchors: torch.Tensor,
                     anchor_tokens: torch.Tensor) -> torch.Tensor:
        """The blocks of one anchor a row from its window alone (no history beyond it): ctx [B, W, dim] main_x at
        positions anchors - W .. anchors - 1 (`context` of those positions' stream means), ctx_visible [B, W] which
        of them exist (the others are masked, whatever they hold); anchors [B] the anchors' positions,
        anchor_tokens [B] their tokens; embed the backbone's. Returns h [B, K, dim], the `hidden` that `forward`
        gives for the same anchors and context; the drafts then come slot by slot from `heads`, each slot's
        prev_token the draft before it. (In eval mode: no MoE load is counted.)"""
        W = self.cfg.dspark.window
        B = anchors.shape[0]
        if ctx.shape[:2] != (B, W) or ctx_visible.shape != (B, W) or anchor_tokens.shape != (B,):
            raise ValueError(f"draft_hidden: ctx must be [B, model.dspark.window={W}, dim], ctx_visible [B, W] and "
                             f"anchors, anchor_tokens [B] (B={B}), got {tuple(ctx.shape)}, "
                             f"{tuple(ctx_visible.shape)}, {tuple(anchor_tokens.shape)}")
        ctx_pos = (anchors[:, None] - W + torch.arange(W, device=anchors.device)).clamp_min(0)  # [B, W]
        return self._blocks(embed, anchors, anchor_tokens, lambda layer: layer.context_kv(ctx, ctx_pos), ctx_visible)

    def heads(self, head: nn.Module, h: torch.Tensor, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov-corrected draft logits [..., V] fp32 and confidence logits [...] fp32 of slots h [..., dim]
        (`draft_hidden`'s) whose target follows prev_tokens [...] (the anchor for slot 0, then the previous draft);
        head the backbone's. What `forward` computes from its blocks' hidden states."""
        prev = self.markov_in(prev_tokens)  # [..., r]
        logits = head(h).float() + self.markov_out(prev).float()
        confidence = self.confidence(torch.cat((h, prev.to(h.dtype)), dim=-1)).squeeze(-1).float()
        return logits, confidence


def acceptance_length(alpha: torch.Tensor) -> torch.Tensor:
    """Per-slot acceptance probabilities alpha [..., K] -> the expected tokens a verification yields,
    tau = 1 + sum_k prod_{j <= k} alpha_j (REFERENCE B6) [...]."""
    return 1 + torch.cumprod(alpha, dim=-1).sum(-1)


@dataclass
class DraftLoss:
    """DeepSpec's drafter objective (REFERENCE B6) of one batch: `loss` (the weighted sum, divided by `weight`, the
    weights' sum, which the caller may replace by the global batch's), and the per-anchor figures."""

    loss: torch.Tensor  # scalar: sum of the weighted terms / weight
    weight: torch.Tensor  # scalar: the sum of the slots' weights
    terms: dict[str, torch.Tensor]  # "ce", "l1", "conf": each term's weighted sum (not divided)
    alpha: torch.Tensor  # [B, A, K] the acceptance probabilities 1 - TV(p_draft, p_target), 0 past the valid prefix
    predicted: torch.Tensor  # [B, A, K] sigmoid of the confidence head, 0 past the valid prefix


def draft_loss(out: DraftOutput, target_logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, *,
               ce: float = 0.1, l1: float = 0.9, conf: float = 1.0, gamma: float = 4.0,
               trained: torch.Tensor | None = None) -> DraftLoss:
    """out: the drafter's block [B, A, K, V]; target_logits [B, A, K, V] the backbone's logits at the same positions
    (its distribution of the token each slot drafts); targets [B, A, K] those tokens; valid [B, A, K] a contiguous
    prefix per anchor (the slots whose target exists). L = sum_k w_k (ce CE + l1 |p_d - p_t|_1 + conf BCE(c_k,
    alpha_k)), w_k = valid x exp(-k / gamma), alpha_k = clamp(1 - |p_d - p_t|_1 / 2, 0, 1) detached. trained [B, A] bool
    or None (all): the anchors whose slots weigh in the loss; the others (held out) are only scored (alpha,
    predicted)."""
    K = out.logits.shape[-2]
    log_pd = out.logits.float().log_softmax(-1)
    p_t = target_logits.float().softmax(-1)
    dist = (log_pd.exp() - p_t).abs().sum(-1)  # [B, A, K] the L1 distance
    alpha = (1 - dist.detach() / 2).clamp(0, 1)
    w = valid.float() * torch.exp(-torch.arange(K, device=dist.device, dtype=torch.float32) / gamma)
    if trained is not None:
        w = w * trained[..., None]
    ce_k = -log_pd.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    bce_k = torch.nn.functional.binary_cross_entropy_with_logits(out.confidence.float(), alpha, reduction="none")
    terms = {"ce": (w * ce_k).sum(), "l1": (w * dist).sum(), "conf": (w * bce_k).sum()}
    weight = w.sum()
    loss = (ce * terms["ce"] + l1 * terms["l1"] + conf * terms["conf"]) / weight.clamp_min(1e-9)
    return DraftLoss(loss, weight, terms, alpha * valid, torch.sigmoid(out.confidence.detach().float()) * valid)
