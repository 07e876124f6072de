"""One forward over the blocks: what its layers share and the pieces every such forward is made of.

Contract: `ForwardState` is the forward's explicit record (made fresh per training forward by `new_state`; serving
makes one per cached call); a layer reads it and returns what it makes (`LayerOutputs`); `forward_blocks`, the one
loop over blocks, is its only writer. `SequenceShard` is the context-parallel seam: plain callables, identity when
one process holds whole sequences (`WHOLE`). `embed_streams`, `forward_blocks`, `final_hidden`, `head_logits` and
`add_expert_loads` are the pieces `Transformer.forward`, the pipeline stages (trainer/parallel/pipeline.py) and
serving (model/serving.py) share, so each computes what the same layers compute in the whole model. Nothing here
knows a layer's class: blocks are the modules passed in.

Design and reasoning: docs/model.md#the-forward-state
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection

import torch
from torch import nn

from model import mhc
from model.rope import rope_tables

if TYPE_CHECKING:  # annotations only
    from model.common import RMSNorm
    from model.config import ModelConfig
    from model.engram import EngramHasher

__all__ = ["SequenceShard", "WHOLE", "LayerOutputs", "ForwardState", "new_state", "embed_streams", "forward_blocks",
           "add_expert_loads", "final_hidden", "head_logits"]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _all_same(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


@dataclass(frozen=True)
class SequenceShard:
    """This process's contiguous chunk of every sequence, and the hooks that reach the rest of it.

    The defaults describe one process holding whole sequences: every hook is the identity. Context parallelism
    (trainer/parallel/context.py) installs implementations; they are plain callables, so the model never sees a
    process group. With T local tokens the chunk covers positions [index * T, (index + 1) * T).
    """

    index: int = 0  # the chunk's place in the sequence
    # (t [B, E_local, C], ...) -> (t [B, E, C], ...): every chunk's compressed entries in sequence order; an entry's
    # gradient returns to the chunk that made it
    gather_entries: Callable[..., tuple[torch.Tensor, ...]] = _all_same
    # kv [B, T, D] -> [B, h + T, D]: the previous chunk's last h window rows first (h = 0 alone; the first chunk's h
    # rows sit at negative positions and are masked); their gradient returns to the previous chunk
    window_halo: Callable[[torch.Tensor], torch.Tensor] = _same
    # t [B, T] -> [B, num_chunks * T]: a per-token tensor of the whole sequence (token ids, masks); no gradient
    gather_tokens: Callable[[torch.Tensor], torch.Tensor] = _same
    # t -> the mean of t over the chunks of the sequence; no gradient (statistics of whole sequences)
    chunk_mean: Callable[[torch.Tensor], torch.Tensor] = _same


WHOLE = SequenceShard()  # one process holds whole sequences (no context parallelism)


@dataclass
class LayerOutputs:
    """What one block adds to its forward, returned by the block and recorded by the loop that runs the blocks
    (`ForwardState.record`); None where the layer makes no such thing."""

    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # Full: (main KV [B, E, D], indexer keys [B, E, Di])
    # index source: its top-k, [B, T, E] bool (reference path) or [B, T, K] int32 entry ids, -1 = empty (Triton
    # path, model/kernels.py)
    selection: torch.Tensor | None = None
    pool: torch.Tensor | None = None  # pool builder: [B, T, E] bool, or [B, T, P] int32 block ids (Triton)
    indexer_kl: torch.Tensor | None = None  # index source: scalar KL (a loss term)
    experts: torch.Tensor | None = None  # [B, T, K] int64 the MoE's chosen experts (kept with state.keep_routing)
    expert_load: torch.Tensor | None = None  # [2, E] int64: tokens routed to each expert (text, image rows)
    balance_loss: torch.Tensor | None = None  # the MoE sequence-wise balance loss (a loss term; None when off)


@dataclass
class ForwardState:
    """What the layers of one forward share (per sequence batch). Layers only read it; the loop that runs them
    (`forward_blocks`) writes each layer's `LayerOutputs` into it, so it is the forward's explicit
    record: what later layers read (KV, top-k, pool, h_{L/2}) and what the loss and the trainer read (indexer KL,
    balance loss, expert loads). Made fresh for every training forward (`new_state`); pipeline
    stages carry what later stages read across each cut (trainer/parallel/pipeline_wire.py)."""

    positions: torch.Tensor  # [T] absolute positions: offset, offset + 1, ...
    phase: str  # indexer phase: "sparse" or "dense_warmup"
    offset: int = 0  # absolute position of the first local token (context parallelism: index * T)
    shard: SequenceShard = field(default_factory=SequenceShard)
    h_mid: torch.Tensor | None = None  # [B, T, dim] the encoder's output (collapsed streams), CED
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # source -> (main, index keys)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> its top-k
    pool: torch.Tensor | None = None  # the candidate pool (one builder per model)
    indexer_kl: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> scalar KL
    balance_loss: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> sequence-balance loss
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [2, E] int64 loads
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, dim] (forward_blocks' hidden_layers)
    # -- serving and replay (model/cache.py, model/serving.py, model/routing.py) --
    cache: object | None = None  # the inference cache (KVCache): positions are then [B, T], a position per row
    call_start: torch.Tensor | None = None  # [B] the cache's length per row when the call began
    routing: object | None = None  # RoutingRecords: recorded top-k and experts to use instead of choosing (R3)
    keep_routing: bool = False  # record every index source's top-k and every MoE layer's experts
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [B, T, K] (keep_routing)
    # a static-shape call (model.serving.decode_step): every KV source presents its whole capacity of entries, masked
    # by visibility, and entries are written without a data-dependent selection (a CUDA graph can capture the call)
    static: bool = False
    # the static decode step's kernels (model.serving.decode_step): "reference" or "triton" (model/serving_decode.py)
    decode_kernels: str = "reference"
    # a cached call on the training forward's kernels (model.serving.serve_forward decides it): every row's length
    # when the call began (None: the reference path). Positions are then [T] from `offset`, as in a training forward
    # (offset > kernel_start where a trimmed prefill skipped rows), and top-k and pool take the kernels' int32 form
    kernel_start: int | None = None
    # bounded-replay simulation (model/replay.py): layer -> [B, T] the first key position each query's window may
    # read (-1: all), and KV source -> (main, keys, [B] entries) the cached global KV the replayed rows keep
    window_floor: dict[int, torch.Tensor] = field(default_factory=dict)
    kv_fixed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _rope: dict = field(default_factory=dict)  # a cache of pure functions of the positions

    def set_rows(self, positions: torch.Tensor) -> None:
        """Continue with other query rows (a bounded-replay prefill trims the decoder's rows)."""
        self.positions = positions
        self._rope.clear()

    def rope(self, cfg, kind: str, positions: torch.Tensor, dtype: torch.dtype, key=None):
        if torch.compiler.is_compiling():
            # A compiled block (trainer.compile) makes its own tables inside its graph, where they fuse: filling the
            # shared cache would be a side effect on the state (an activation-checkpointed graph refuses one) and
            # make each block's graph depend on which kinds earlier blocks had cached.
            return rope_tables(cfg, kind, positions, dtype)
        key = (kind, key, dtype)
        if key not in self._rope:
            self._rope[key] = rope_tables(cfg, kind, positions, dtype)
        return self._rope[key]

    def record(self, layer: int, out: LayerOutputs) -> None:
        """Keep what layer `layer` made (its `LayerOutputs`) for the layers after it and for the loss."""
        for name in ("kv", "selection", "indexer_kl", "balance_loss", "expert_load", "experts"):
            value = getattr(out, name)
            if value is not None:
                getattr(self, name)[layer] = value
        if out.pool is not None:
            self.pool = out.pool


# -- the pieces of a forward (state, embedding, blocks, head) ---------------------------------------------------------
# shared by `Transformer.forward`, the pipeline stages (trainer/parallel/pipeline.py) and serving (model/serving.py),
# so a stage or a cached call computes exactly what the same layers compute in the whole model.


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
