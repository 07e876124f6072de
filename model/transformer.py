"""The V4.1 backbone: embedding -> 40 mHC blocks (CED: 20 encoder + 20 decoder) -> norm -> head. With a vision tower
(model.vision.num_layers > 0, model/vision/) the tower's embeddings replace the token embedding at the image
placeholders (`embed_streams`), in the training forward only.

Shape legend: B batch, T tokens, n mHC streams, dim hidden width, V vocabulary, N image patches, K values per patch,
P placeholder tokens (every image's START / rows of IMAGE + NEWLINE / END, model/vision/vit.py `layout`).

Block order (REFERENCE A6 "The lag"): Engram (if any) updates the streams first; the attention site predicts its
coefficients from the streams and the attention reads the streams collapsed with the PREVIOUS site's `pre`; the FFN
site predicts its coefficients from the updated streams and the FFN reads them collapsed with the attention site's
`pre`. That lag is what lets residual update, input mixing and coefficient prediction run as one pass (model/mhc.py).

CED: the collapsed output of the last encoder layer is h_{L/2}; decoder Full layers compress their global KV from
their own norm of it, never from their own stream. It travels in the ForwardState (and across pipeline stages).

State (model/attention.py `ForwardState`): a block reads what earlier blocks made from the state and returns what
it makes (`LayerOutputs`); `forward_blocks`, the one loop over blocks (the whole model's and every pipeline
stage's), records it. `Transformer.forward(..., outputs=True)` returns a `ModelOutput`: logits, the final hidden
states (and chosen layers'), the auxiliary losses and the state; with logits=False too, everything but the head
(logits None: trainer.fused_loss computes the head with the loss, trainer/fused_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import torch
from torch import nn

from model import kernels as kern
from model import mhc
from model.attention import CSA2Attention, ForwardState, SequenceShard
from model.common import RMSNorm, init_normal
from model.config import ModelConfig
from model.engram import Engram, EngramHasher
from model.layer_plan import LayerSpec, build_layer_plan
from model.moe import MoE
from model.vision import VisionEncoder, image_token_count


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
        self.ffn = MoE(cfg.dim, cfg.moe, cfg.init_std)
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
        S, x, cf = mhc.mhc_step(self.impl, y, S, ca, ca.pre, self.hc_ffn, self.kernel_path)
        experts = None if state.routing is None else state.routing.expert_rows(self.spec.index, state)
        y, made.expert_load, made.balance_loss = self.ffn(self.ffn_norm(x), image_mask, experts,
                                                          return_experts=state.keep_routing)
        if state.keep_routing:
            made.experts = self.ffn.chosen_experts
        S = mhc.expand(y, S, cf.post, cf.comb)
        return S, cf.pre, made


# The pieces of the forward (state, embedding, blocks, head), shared by `Transformer.forward` and the pipeline
# stages (trainer/parallel/pipeline.py), so a stage computes exactly what the same layers compute in the whole model.


def new_state(cfg: ModelConfig, input_ids: torch.Tensor, shard: SequenceShard, hasher: EngramHasher | None = None,
              image_mask: torch.Tensor | None = None) -> tuple[ForwardState, dict | None]:
    """The fresh ForwardState of one forward on input_ids [B, T], and the Engram row ids of its tokens ({layer: (row_ids
    [B, T, C], dead [B, T])}, None without Engram). Under context parallelism input_ids is this process's chunk:
    positions start at shard.index * T, and since an n-gram reaches back max_ngram - 1 tokens, possibly into the
    previous chunk, the ids are hashed on the whole sequence (`shard.gather_tokens`: ids are cheap), then sliced."""
    T = input_ids.shape[1]
    offset = shard.index * T
    state = ForwardState(positions=torch.arange(T, device=input_ids.device) + offset, phase=cfg.indexer.phase,
                         offset=offset, shard=shard)
    if hasher is None:
        return state, None
    image_mask = None if image_mask is None else shard.gather_tokens(image_mask)
    rows = hasher.for_tokens(shard.gather_tokens(input_ids), image_mask)
    mine = slice(offset, offset + T)
    return state, {layer: (row_ids[:, mine], dead[:, mine]) for layer, (row_ids, dead) in rows.items()}


def embed_streams(embed: nn.Embedding, input_ids: torch.Tensor, num_streams: int,
                  image_embeds: torch.Tensor | None = None, image_token_id: int = -1,
                  sequence_shard: tuple[int, int] | None = None):
    """input_ids [B, T] -> (S [B, T, n, dim] every stream the embedding, pre [n] the first site's one-hot `pre`).

    image_embeds [P, dim] (the vision tower's output, `Transformer.image_embeddings`) take the place of the token
    embedding at the P positions where input_ids == image_token_id, in row-major order over [B, T]. Under sequence
    parallelism the embedding returns this rank's chunk of the sequence, [B, T / n, dim] for chunk r of n
    (`sequence_shard` = (r, n), set by trainer/parallel/tensor.py `apply_tp`): the chunk's placeholders take their
    features from the whole sequence's layout (every tp rank holds every image's features)."""
    h = embed(input_ids)
    if image_embeds is not None:
        mask = (input_ids == image_token_id)[..., None]  # [B, T, 1]
        if h.shape[:2] == input_ids.shape:
            # masked_scatter fills the masked positions in row-major order, each with the next dim values; it is
            # differentiable in its source, so the LM loss reaches the tower.
            h = h.masked_scatter(mask, image_embeds.to(h.dtype))
        elif sequence_shard is not None:
            r, n = sequence_shard
            chunk = slice(r * h.shape[1], (r + 1) * h.shape[1])
            whole = torch.zeros(*input_ids.shape, h.shape[-1], dtype=h.dtype, device=h.device)
            whole = whole.masked_scatter(mask, image_embeds.to(h.dtype))  # [B, T, dim]
            h = torch.where(mask[:, chunk], whole[:, chunk], h)
        else:
            raise ValueError(f"embed_streams: the embedding returned {h.shape[1]} of the {input_ids.shape[1]} "
                             "positions (a sequence shard) but no sequence_shard says which")
    return mhc.init_streams(h, num_streams), mhc.first_pre(num_streams, device=h.device)


def forward_blocks(blocks, S, pre, state: ForwardState, num_encoder_layers: int, engram_in=None, image_mask=None,
                   hidden_layers: Collection[int] = ()):
    """Run consecutive blocks (any contiguous slice of the layers) on (S, pre); returns (S, pre) after the last and
    records every block's `LayerOutputs` in `state` (the only writer of the state during a forward).

    h_{L/2} is collapsed on entry to the first decoder layer (index num_encoder_layers) when that layer is in the
    slice; a slice that starts later reads it from state.h_mid, as do the KV, top-k and pool its layers reuse.
    engram_in: {layer index: (row_ids, dead)} for the Engram layers of the slice. hidden_layers: layers whose
    hidden states (the streams collapsed as the next layer's attention reads them, before its norm) go to
    state.hidden."""
    for layer in blocks:
        i = layer.spec.index
        if i == num_encoder_layers and state.h_mid is None:  # (a trimmed prefill sets it on every row first)
            state.h_mid = mhc.collapse(S, pre)
        e_in = engram_in[i] if layer.engram is not None else None
        S, pre, made = layer(S, pre, state, e_in, image_mask)
        state.record(i, made)
        if i in hidden_layers:
            state.hidden[i] = mhc.collapse(S, pre)
    return S, pre


def add_expert_loads(blocks, state: ForwardState) -> None:
    """Add the forward's expert loads (state.expert_load) to the balancing counters of `blocks`' MoE layers (what
    `update_bias` reads after the optimiser step)."""
    for layer in blocks:
        load = state.expert_load.get(layer.spec.index)
        if load is not None:
            layer.ffn.add_load(load)


def final_hidden(norm: RMSNorm, S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse with the last layer's `pre`, then the final norm: [B, T, dim], what the head reads."""
    return norm(mhc.collapse(S, pre))


def head_logits(norm: RMSNorm, head: nn.Linear, S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse with the last layer's `pre`, norm, head: logits [B, T, V] in fp32."""
    return head(final_hidden(norm, S, pre)).float()


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
        from model.accounting import train_flops_per_token

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
        from model.cache import KVCache

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
            from model.serving import decode_step

            return decode_step(self, input_ids, cache)
        if cache is not None:
            from model.serving import routing_records, serve_forward

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
            from model.serving import routing_records

            routing_out = routing_records(self, state)
        return ModelOutput(head_out, hidden, aux, metrics, state, dict(state.hidden), routing_out)

    def _simulate_replay(self, state: ForwardState, input_ids, image_mask, cuts) -> None:
        """Bounded-replay simulation (model/replay.py): truncated windows at the cuts; for encoder (prefix-cache)
        cuts, the global KV of the cached prefix from an exact forward without gradient."""
        from model.replay import window_floors

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
