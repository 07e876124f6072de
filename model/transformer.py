"""The V4.1 backbone: embedding -> 40 mHC blocks (CED: 20 encoder + 20 decoder) -> norm -> head. With a vision tower
(model.vision.num_layers > 0, model/vision/) the tower's embeddings replace the token embedding at the image
placeholders (`embed_streams`), in the training forward only.

Shape legend: B batch, T tokens, n mHC streams, dim hidden width, V vocabulary, N image patches, K values per patch,
P placeholder tokens (every image's START / rows of IMAGE + NEWLINE / END, model/vision/vit.py `layout`).

The blocks are model/block.py's; one forward's state and pieces are model/forward.py's (CED: the collapsed output
of the last encoder layer, h_{L/2}, travels in the state). `Transformer.forward(..., outputs=True)` returns a
`ModelOutput`: logits, the final hidden states (and chosen layers'), the auxiliary losses and the state; with
logits=False too, everything but the head (logits None: trainer.fused_loss computes the head with the loss). With a
cache it runs serving's path (model/serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import torch
from torch import nn

from model.accounting import train_flops_per_token
from model.block import Block
from model.cache import KVCache
from model.common import RMSNorm, init_normal
from model.config import ModelConfig
from model.engram import EngramHasher
from model.forward import (ForwardState, SequenceShard, add_expert_loads, embed_streams, final_hidden,
                           forward_blocks, new_state)
from model.layer_plan import build_layer_plan
from model.moe import MoE
from model.replay import window_floors
from model.serving import decode_step, routing_records, serve_forward
from model.vision import VisionEncoder, image_token_count


@dataclass
class ModelOutput:
    """What `Transformer.forward(..., outputs=True)` returns."""

    logits: torch.Tensor | None  # [B, T, V] fp32; None from forward(..., logits=False)
    hidden: torch.Tensor  # [B, T, dim] the final hidden states: after the final norm, what the head reads
    aux: dict[str, torch.Tensor]  # weighted auxiliary losses to add to the LM loss ("indexer_kl", "moe_seq_balance")
    metrics: dict[str, float]  # their unweighted values
    state: ForwardState  # the forward's record: KV, top-k, pool, per-layer losses and loads, `hidden` of chosen layers
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # hidden_layers' [B, T, dim] (state.hidden)
    routing: object | None = None  # RoutingRecords of the forward's choices (keep_routing=True)


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
        self.vision = None
        if cfg.vision.num_layers > 0:
            if not 0 <= cfg.image_token_id < cfg.vocab_size:
                raise ValueError(f"model.image_token_id={cfg.image_token_id} must be a token id in [0, "
                                 f"model.vocab_size={cfg.vocab_size}): the placeholder the vision tower's "
                                 f"embeddings replace (model.vision.num_layers={cfg.vision.num_layers})")
            self.vision = VisionEncoder(cfg.vision, cfg.dim, cfg.init_std)
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
        if self.vision is not None:
            self.vision.init_weights()

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
        return train_flops_per_token(self, seq_len)

    def set_canonical_vocab(self, canonical_map: torch.Tensor) -> None:
        """Install a tokenizer's canonical vocabulary for Engram hashing (model.engram.canonical_vocab_from_tokenizer)."""
        if self.hasher is not None:
            self.hasher.set_canonical_map(canonical_map)

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]

    # -- forward -------------------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, replay: str = "halo", **kw):
        """An inference cache (model/cache.py) for `batch_size` requests of up to `max_len` tokens. replay: "none"
        (full-depth prefill), "window" or "halo" (decoder bounded replay; "halo", the default, is exact: see
        KVCache). On a meta-device model it allocates meta buffers: byte accounting without weights."""
        return KVCache(self, batch_size, max_len, replay, **kw)

    def image_embeddings(self, input_ids: torch.Tensor, images) -> torch.Tensor:
        """The vision tower's [P, dim] embeddings of `images` = (pixel_values [N, K], grids [(h_i, w_i)]), checked
        against input_ids [B, T]: ValueError unless the model has a tower and the images' placeholder tokens
        (model.vision.vit.image_token_count each) are exactly the P positions holding model.image_token_id."""
        cfg = self.cfg
        if self.vision is None:
            raise ValueError(f"images given to a text-only model (model.vision.num_layers=0, model {cfg.name})")
        if self.sequence_shard != SequenceShard():
            raise ValueError("images under context parallelism (cp > 1) are not wired yet: an image's placeholder "
                             "run may cross this process's chunk")
        pixel_values, grids = images
        grids = self.vision.check(pixel_values, grids)
        expected = sum(image_token_count(g, cfg.vision.unshuffle) for g in grids)
        found = int((input_ids == cfg.image_token_id).sum())  # a host sync, once per forward with images
        if found != expected:
            raise ValueError(f"input_ids hold {found} image placeholder tokens (model.image_token_id="
                             f"{cfg.image_token_id}), the {len(grids)} images' grids {grids} make {expected}")
        return self.vision(pixel_values, grids)

    def forward(self, input_ids: torch.Tensor, *, images=None, image_mask: torch.Tensor | None = None,
                outputs: bool = False, hidden_layers: Collection[int] = (), cache=None, routing=None,
                keep_routing: bool = False, replay_cuts=None, logits: bool = True, static: bool = False):
        """input_ids [B, T] -> logits [B, T, V] (fp32); with outputs=True, a `ModelOutput` (logits, final hidden
        states, the auxiliary losses to add to the LM loss, the forward state), with the hidden states of
        `hidden_layers` too. In training mode the forward's expert loads are added to the MoE balancing counters.

        images: (pixel_values [N, K], grids [(h_i, w_i)]) of the images whose placeholder runs input_ids holds, in
        the order the runs appear (row-major over [B, T]); the tower's output replaces the embedding at every
        position holding model.image_token_id (`image_embeddings` checks the counts). On a model with a tower,
        image_mask defaults to input_ids == model.image_token_id, so those positions route with the MoE's image
        bias (Engram's n-grams break at them either way). Images go only into the training forward (no cache):
        the cache, static decode and bounded-replay paths refuse them, as do context and pipeline parallelism.

        cache: an inference cache (`new_cache`): the logits of the given tokens, which are appended to it (the first
        call is the prefill, later ones decode one or more tokens); no balancing counts. routing: RoutingRecords
        to replay instead of choosing (model/routing.py); keep_routing: record the choices (ModelOutput.routing).
        replay_cuts: model/replay.py's ReplayCuts, the bounded-replay simulation (training only). logits=False (with
        outputs=True, no cache): the head is not run, ModelOutput.logits is None and .hidden is the head's input
        (the fused head + loss, trainer/fused_loss.py); everything else is the same forward. static=True (with a
        cache, one token per row): the decode step with static shapes and no host synchronisation, which a CUDA graph
        can capture (model.serving.decode_step; the logits only)."""
        cfg = self.cfg
        if not logits and (not outputs or cache is not None):
            raise ValueError("Transformer.forward(logits=False) runs with outputs=True and without a cache")
        if images is not None and (cache is not None or static or replay_cuts is not None):
            raise ValueError("Transformer.forward(images=...) runs only the training forward: the cache, static "
                             "decode and bounded-replay (replay_cuts) paths take no images yet")
        if static:
            if cache is None or outputs or routing is not None or keep_routing or image_mask is not None:
                raise ValueError("Transformer.forward(static=True) is a text decode step on a cache: logits only, "
                                 "no routing records")
            return decode_step(self, input_ids, cache)
        if cache is not None:
            scores, state = serve_forward(self, input_ids, cache, image_mask=image_mask, routing=routing,
                                          keep_routing=keep_routing)
            if not outputs:
                return scores
            return ModelOutput(scores, None, {}, {}, state,
                               routing=routing_records(self, state) if keep_routing else None)
        image_embeds = None if images is None else self.image_embeddings(input_ids, images)
        if self.vision is not None and image_mask is None:
            image_mask = input_ids == cfg.image_token_id
        state, engram_in = new_state(cfg, input_ids, self.sequence_shard, self.hasher, image_mask)
        state.routing, state.keep_routing = routing, keep_routing
        if replay_cuts is not None:
            self._simulate_replay(state, input_ids, image_mask, replay_cuts)
        S, pre = embed_streams(self.embed, input_ids, cfg.mhc.num_streams, image_embeds, cfg.image_token_id,
                               getattr(self, "image_sequence_shard", None))
        S, pre = forward_blocks(self.layers, S, pre, state, cfg.num_encoder_layers, engram_in, image_mask,
                                hidden_layers)
        if self.training:  # an evaluation or scoring forward (eval mode) moves no balancing bias
            add_expert_loads(self.layers, state)
        hidden = final_hidden(self.norm, S, pre)
        head_out = self.head(hidden).float() if logits else None
        if not outputs:
            return head_out
        aux, metrics = self.aux_losses(state)
        routing_out = None
        if keep_routing:
            routing_out = routing_records(self, state)
        return ModelOutput(head_out, hidden, aux, metrics, state, dict(state.hidden), routing_out)

    def _simulate_replay(self, state: ForwardState, input_ids, image_mask, cuts) -> None:
        """Bounded-replay simulation (model/replay.py): truncated windows at the cuts; for encoder (prefix-cache)
        cuts, the global KV of the cached prefix from an exact forward without gradient."""
        if self.sequence_shard != SequenceShard():
            raise ValueError("bounded-replay simulation does not run under context parallelism (cp > 1)")
        state.window_floor = window_floors(self.cfg, cuts, state.positions)
        if cuts.encoder is not None and bool((cuts.encoder >= 0).any()):
            for src, (main, keys) in self._exact_kv(input_ids, image_mask).items():
                n = torch.where(cuts.encoder >= 0, cuts.encoder // self.plan[src].ratio, 0)
                state.kv_fixed[src] = (main, keys, n)

    @torch.no_grad()
    def _exact_kv(self, input_ids, image_mask) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every KV source's (main KV, indexer keys) of an unsimulated forward: the layers up to the last source,
        no head, no balancing counts (what an earlier request's exact pass left in the prefix cache)."""
        cfg = self.cfg
        last = max(s.index for s in self.plan if s.owns_kv)
        state, engram_in = new_state(cfg, input_ids, self.sequence_shard, self.hasher, image_mask)
        S, pre = embed_streams(self.embed, input_ids, cfg.mhc.num_streams)
        forward_blocks(self.layers[:last + 1], S, pre, state, cfg.num_encoder_layers, engram_in, image_mask)
        return state.kv

    def aux_losses(self, state: ForwardState) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The weighted auxiliary losses of a forward ({name: scalar}) and their unweighted values: the mean indexer
        KL over index sources times indexer.loss_coef, the MoE sequence-balance losses summed over layers."""
        metrics: dict[str, float] = {}
        aux: dict = {}
        if state.indexer_kl:
            kl = torch.stack(list(state.indexer_kl.values())).mean()
            aux["indexer_kl"] = self.cfg.indexer.loss_coef * kl
            metrics["indexer_kl"] = float(kl.detach())
        if state.balance_loss:
            total = torch.stack(list(state.balance_loss.values())).sum()
            aux["moe_seq_balance"] = total
            metrics["moe_seq_balance"] = float(total.detach())
        return aux, metrics
