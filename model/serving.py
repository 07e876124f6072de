"""The serving path of one CSA2 layer and of the whole model on the inference cache (model/cache.py), filling it.

Contract: `cached_attention` computes what `CSA2Attention.forward` computes for the same tokens of a whole sequence
(the teacher-forced forward) from what the cache keeps of the earlier ones; `serve_forward` is
`Transformer.forward(ids, cache=...)` (logits of the new tokens, appended; a trimmed prefill's skipped rows get NaN
logits); `decode_step` is one token per row with static shapes and no host synchronisation (a CUDA graph can capture
it; `compiled_decode_step` hands it to torch.compile); `routing_records` returns what a keep_routing forward chose.
Per-row positions [B, T] let requests of different lengths decode together. Where the model's kernel switch is
Triton (`on_kernels`) serve_forward runs `prefill_attention` on the training forward's kernels (model/prefill.py);
`decode_step(..., kernels="triton")` runs a decode step's attention and indexer on the serving kernels
(model/serving_decode.py); both are tested equal to the reference operations.

Design and reasoning: docs/generation.md#the-serving-path-of-a-layer
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from kernels.norm_rope_ref import rms_norm
from model import kernels as kern
from model import mhc, prefill
from model.common import full_precision, local
from model.csa2 import attend, selected_ids
from model.forward import WHOLE, ForwardState, LayerOutputs, embed_streams, forward_blocks, head_logits
from model.rope import apply_rope
from model.routing import RoutingRecords
from model.serving_decode import DECODE_KERNELS, check_decode_kernels, decode_attention

__all__ = ["serve_forward", "on_kernels", "decode_step", "cached_attention", "prefill_attention", "routing_records",
           "visible_rows", "StoredEntries"]

REF = "reference"


def visible_rows(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """positions [B, T] -> [B, T, E] bool: entry t visible to the query at p iff t < (p + 1) // ratio."""
    t = torch.arange(num_entries, device=positions.device)
    return t < ((positions + 1) // ratio)[..., None]


def _stored(store, pre: torch.Tensor, fmt: str | None) -> tuple[tuple, torch.Tensor]:
    """Encode rows (pre: before the forward's fake-quant of format fmt) -> (stored parts, their decoded values)."""
    value = kern.fake_quant(pre, fmt, REF)
    parts = store.encode(value, pre, fmt)
    return parts, store.decode(parts)


def _compress_new(layer, kv_src: torch.Tensor, lc, call_start: torch.Tensor):
    """Full layer: the entries the call's rows close. kv_src [B, Tk, dim] (rows at call_start + 0..Tk-1).
    Returns (latent [B, G, D] normed pre-RoPE, entry ids [B, G], closed [B, G] bool) and writes the call's rows into
    the ring `lc.pending`."""
    comp = layer.compressor
    m = comp.ratio
    B, Tk, _ = kv_src.shape
    # the compressor's pieces on this rank's (replicated) weights: a tensor-parallel plan hooks the module's call
    def norm(t):
        return rms_norm(t, local(comp.norm.weight), comp.norm.eps)

    if m == 1:
        ids = call_start[:, None] + torch.arange(Tk, device=kv_src.device)
        return norm(nn.functional.linear(kv_src, local(comp.wkv.weight))), ids, torch.ones_like(ids, dtype=torch.bool)
    with full_precision(kv_src.device.type):  # fp32 under a bf16 autocast too, as Compressor.forward
        kv = nn.functional.linear(kv_src.float(), local(comp.wkv.weight).float())  # [B, Tk, D]
        gate = nn.functional.linear(kv_src.float(), local(comp.wgate.weight).float())
    new = torch.stack((kv, gate), dim=2)  # [B, Tk, 2, D]
    held = call_start % m  # [B] tokens of the open group before the call
    ring = lc.pending  # [B, C, 2, D]: the last C tokens' rows, position p at slot p % C
    C, D = ring.shape[1], ring.shape[-1]
    # the open group's rows before the call (positions call_start - held + i; the rows i >= held are never read)
    slot = ((call_start - held)[:, None] + torch.arange(m - 1, device=kv_src.device)) % C  # [B, m - 1]
    held_rows = ring.gather(1, slot[..., None, None].expand(-1, -1, 2, D))
    both = torch.cat((held_rows, new), dim=1)  # [B, m - 1 + Tk, 2, D]: held rows first (left-aligned), then new
    G = -(-(m - 1 + Tk) // m)
    j = torch.arange(G * m, device=kv_src.device)
    src = torch.where(j < held[:, None], j, m - 1 + j - held[:, None])  # [B, G*m] row of `both` at group slot j
    src = src.clamp(max=both.shape[1] - 1)
    rows = both.gather(1, src[..., None, None].expand(-1, -1, 2, both.shape[-1]))  # [B, G*m, 2, D]
    kv_g, gate_g = rows[:, :, 0].view(B, G, m, -1), rows[:, :, 1].view(B, G, m, -1)
    latent = norm((gate_g.softmax(dim=2) * kv_g).sum(dim=2).to(kv_src.dtype))
    first = (call_start - held) // m  # [B] id of the group the call starts in
    ids = first[:, None] + torch.arange(G, device=kv_src.device)
    closed = (torch.arange(1, G + 1, device=kv_src.device) * m)[None] <= (held + Tk)[:, None]
    # the ring keeps the call's last C rows: the open group after the call, and with a speculation headroom the rows
    # of the groups a rollback reopens (model/cache.py)
    n = min(Tk, C)
    slot = (call_start[:, None] + torch.arange(Tk - n, Tk, device=kv_src.device)) % C  # [B, n]
    ring.scatter_(1, slot[..., None, None].expand(-1, -1, 2, D), new[:, Tk - n:])
    return latent, ids, closed


def _write_entries(layer, lc, state, kv_src: torch.Tensor):
    """Full layer: write the closed groups' main KV and indexer keys; return both stores' entries (decoded on
    demand)."""
    a, qc = layer.cfg.attention, layer.cfg.quant
    call_start = state.call_start
    latent, ids, closed = _compress_new(layer, kv_src, lc, call_start)
    m = layer.spec.ratio
    main_fmt, key_fmt = "fp4" if qc.main_kv == "fp4" else None, "fp4_ue8m0" if qc.index == "fp4" else None
    if state.kernel_start is not None:
        # every row starts at state.offset: one row of positions; k_norm fused where the kernel may read its weight
        cos, sin = state.rope(a, "compress", ids[0] * m, latent.dtype, key=("cache_entries", m))
        k_norm = layer.indexer.k_norm if kern.fuses_norm(layer.indexer.k_norm, "triton") else None
        main_parts = prefill.store_record(lc.main, latent, None, cos, sin, main_fmt)
        key_parts = prefill.store_record(lc.keys, layer.indexer.keys(latent, norm=k_norm is None), k_norm, cos, sin,
                                         key_fmt)
    else:
        cos, sin = state.rope(a, "compress", ids * m, latent.dtype, key=("cache_entries", m))
        main_pre = apply_rope(latent, cos, sin)
        keys_pre = apply_rope(layer.indexer.keys(latent), cos, sin)
        main_parts, _ = _stored(lc.main, main_pre, main_fmt)
        key_parts, _ = _stored(lc.keys, keys_pre, key_fmt)
    # a stored entry stays (prefix-cache replay recomputes rows whose global KV is cached)
    capacity = lc.main.buffers[0].shape[1]
    write = closed & (ids >= lc.entries[:, None]) & (ids < capacity)
    if state.static:
        # every group's slot is written, with its old bytes where the group does not close: no selection of the
        # rows (its size would be data), and every entry up to the capacity is presented (masked by visibility)
        slot = ids.clamp(0, capacity - 1)
        lc.main.write_where(write, slot, main_parts)
        lc.keys.write_where(write, slot, key_parts)
    else:
        b, g = write.nonzero(as_tuple=True)
        lc.main.write(b, ids[b, g], tuple(p[b, g] for p in main_parts))
        lc.keys.write(b, ids[b, g], tuple(p[b, g] for p in key_parts))
    lc.entries.copy_(torch.maximum(lc.entries, (call_start + kv_src.shape[1]) // m))
    E = capacity if state.static else int(lc.entries.max())
    if state.kernel_start is not None:  # every stored entry, decoded, as the training forward hands its entries on
        return lc.main.read_prefix(E, impl="triton"), lc.keys.read_prefix(E, impl="triton")
    return StoredEntries(lc.main, E), StoredEntries(lc.keys, E)


class StoredEntries:
    """A KV source's store in the cache (main KV or indexer keys), decoded on demand: every entry (a prefill's dense
    attention, the reference scoring) or only the rows a decode step's top-k selected (what serving reads); the
    decode kernels read `store`'s bytes themselves."""

    def __init__(self, store, num_entries: int):
        self.store, self.num_entries = store, num_entries
        self._dense = None

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.store.read_prefix(self.num_entries)
        return self._dense

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, N] (in range) -> [B, N, D]."""
        return self.store.read(ids)


def cached_attention(layer, x: torch.Tensor, state, kv_in: torch.Tensor | None):
    """`CSA2Attention.forward` on the inference cache: x [B, T, dim] the new rows' attention input (positions
    state.positions [B, T]); kv_in the compressor input of a Full layer over the whole call. Returns (the attention
    output before the output projection [B, T, H, D], cos, sin, LayerOutputs). A call serve_forward runs on the
    kernels goes to `prefill_attention`; the static decode step on the serving kernels to `decode_attention`."""
    if state.kernel_start is not None:
        return prefill_attention(layer, x, state, kv_in)
    if state.decode_kernels == "triton":
        # the static decode step on the serving kernels (model/serving_decode.py): the same entry writes, then the
        # window row, the index source's choice and the attention on the stored bytes
        made = LayerOutputs()
        if layer.spec.owns_kv:
            lc = state.cache.layers[layer.spec.index]
            made.kv = _write_entries(layer, lc, state, kv_in if kv_in is not None else x)
        return decode_attention(layer, x, state, made)
    a, qc = layer.cfg.attention, layer.cfg.quant
    spec = layer.spec
    lc = state.cache.layers[spec.index]
    B, T, _ = x.shape
    pos = state.positions  # [B, T]
    W = a.window
    made = LayerOutputs()
    cos, sin = state.rope(a, spec.rope, pos, x.dtype)

    q_res, q = layer.queries(x, cos, sin)  # [B, T, H, D]
    swa_pre = apply_rope(layer.kv_norm(layer.wkv(x)), cos, sin)
    swa_parts, kv_new = _stored(lc.swa, swa_pre, "fp8" if qc.swa_kv == "fp8" else None)

    # window keys: the ring's last W positions before the call (those from swa_start on), then the new rows; the
    # ring has R >= W rows (a speculation headroom: model/cache.py), position p at slot p % R
    start = state.call_start
    R = lc.swa.buffers[0].shape[1]
    ring_pos = start[:, None] - W + torch.arange(W, device=x.device)  # [B, W]
    ring_ok = (ring_pos >= state.cache.swa_start[:, None]) & (ring_pos >= 0)
    ring = lc.swa.read(ring_pos % R)
    keys = torch.cat((ring, kv_new), dim=1)  # [B, W + T, D]
    k_pos = torch.cat((ring_pos, pos), dim=1)
    k_ok = torch.cat((ring_ok, torch.ones_like(pos, dtype=torch.bool)), dim=1)
    win_mask = (k_pos[:, None] <= pos[..., None]) & (k_pos[:, None] > pos[..., None] - W) & k_ok[:, None]
    n = min(T, R)  # the ring keeps the last R rows
    b = torch.arange(B, device=x.device)[:, None].expand(B, n)
    lc.swa.write(b.flatten(), (pos[:, T - n:] % R).flatten(), tuple(p[:, T - n:].flatten(0, 1) for p in swa_parts))

    kv_cmp = cmp_mask = None
    if spec.ratio > 0:
        if spec.owns_kv:
            made.kv = _write_entries(layer, lc, state, kv_in if kv_in is not None else x)
        entries, idx_keys = made.kv if spec.owns_kv else state.kv[spec.kv_source]
        E = entries.num_entries
        visible = visible_rows(pos, E, spec.ratio)
        if spec.owns_indexer:
            made.selection, made.pool = _select(layer, x, q_res, idx_keys.dense(), visible, state)
        if state.phase == "dense_warmup":
            cmp_mask = visible
        else:
            cmp_mask = made.selection if spec.owns_indexer else state.selection[spec.index_source]
        K = layer.cfg.csa2.index_topk
        if E == 0:
            kv_cmp = None
        elif state.phase == "sparse" and T * K < E:
            # decode: read and attend to the selected entries only (query t sees its own K slots)
            ids = selected_ids(cmp_mask, K)  # [B, T, K], -1 past the chosen
            kv_cmp = entries.rows(ids.clamp(min=0).flatten(1).long())  # [B, T * K, D]
            own = torch.eye(T, dtype=torch.bool, device=x.device).repeat_interleave(K, dim=1)  # [T, T * K]
            cmp_mask = own[None] & (ids >= 0).flatten(1)[:, None]
        else:
            kv_cmp = entries.dense()
    out, _ = attend(q, keys, kv_cmp, win_mask, cmp_mask, local(layer.attn_sink))
    return out, cos, sin, made


def _select(layer, x, q_res, keys, visible, state):
    """Index source on the cache: (top-k [B, T, E] bool, pool or None), by the training forward's reference
    scoring and choice (`CSA2Attention.pick`) over the stored entries each row's queries see."""
    qi, w = layer.index_queries(x, q_res, state, REF)
    _, _, selection, pool = layer.pick(qi, w, keys, visible, state)
    return selection, pool


def prefill_attention(layer, x: torch.Tensor, state, kv_in: torch.Tensor | None):
    """`cached_attention` on the training forward's kernels, for a call whose rows all start at state.offset
    (positions [T]): the fused norm + RoPE + quantisation writes the SWA rows' and the closed groups' cache records,
    the indexer kernels score the stored entries and pick the top-k (and the pool), the sparse attention kernel
    attends to the window (ring rows before the call included) and the top-k; nothing is [B, H, T, E]. Returns what
    `cached_attention` returns, top-k and pool in the kernels' int32 form."""
    a, qc = layer.cfg.attention, layer.cfg.quant
    spec = layer.spec
    lc = state.cache.layers[spec.index]
    B, T, _ = x.shape
    pos, start = state.positions, state.offset  # [T], int
    W = a.window
    made = LayerOutputs()
    cos, sin = state.rope(a, spec.rope, pos, x.dtype)

    q_res, q = layer.queries(x, cos, sin)  # [B, T, H, D]
    swa_parts = prefill.store_record(lc.swa, layer.wkv(x), layer.kv_norm, cos, sin,
                                     "fp8" if qc.swa_kv == "fp8" else None)
    kv_new = lc.swa.decode(swa_parts, impl="triton")  # [B, T, D]: every key is what the cache stores
    # the ring rows a window may reach (positions before the call: call0 - n .. call0 - 1), read before the call's
    # writes; a trimmed prefill's rows start later than the call (start > call0)
    R = lc.swa.buffers[0].shape[1]
    call0 = state.kernel_start
    n = min(W - 1, call0)
    ring = ring_ok = None
    if n:
        ring_pos = call0 - n + torch.arange(n, device=x.device)  # [n]
        ring = lc.swa.read((ring_pos % R).expand(B, n), impl="triton")  # [B, n, D]
        ring_ok = ring_pos[None] >= state.cache.swa_start[:, None]  # [B, n]
    k = min(T, R)  # the ring keeps the last R rows
    rows = torch.arange(B, device=x.device).repeat_interleave(k)
    lc.swa.write(rows, (pos[T - k:] % R).repeat(B), tuple(p[:, T - k:].flatten(0, 1) for p in swa_parts))

    kv_cmp = topk = None
    if spec.ratio > 0:
        if spec.owns_kv:
            made.kv = _write_entries(layer, lc, state, kv_in if kv_in is not None else x)
        entries, idx_keys = made.kv if spec.owns_kv else state.kv[spec.kv_source]
        E = entries.shape[1]
        if spec.owns_indexer:
            qi, w = layer.index_queries(x, q_res, state, "triton")
            _, _, made.selection, made.pool = layer.pick_kernels(qi, w, idx_keys, E, state)
        if E:
            kv_cmp = entries
            topk = made.selection if spec.owns_indexer else state.selection[spec.index_source]
    out = prefill.ring_attention(q, kv_new, ring, ring_ok, start - call0, kv_cmp, topk, local(layer.attn_sink), W)
    return out, cos, sin, made


# -- the whole model on the cache -----------------------------------------------------------------------------------
def _kept_rows(cache, model, T: int) -> int:
    """Rows the decoder (after its first layer) runs on in this prefill: T without replay, else the replay's span."""
    cfg = model.cfg
    W = cfg.attention.window
    if cache.replay == "none":
        return T
    if cache.replay == "window":
        return min(T, W)
    n = cfg.num_layers - cfg.num_encoder_layers - 1  # decoder layers after the first: each shrinks the exact rows
    return min(T, W + max(n - 1, 0) * (W - 1))


def _slice_rows(t, n: int):
    """The last n token rows of a [B, T, ...] tensor (a [n_streams] `pre` passes through)."""
    return t if t is None or t.dim() < 2 else t[:, t.shape[1] - n:]


def serve_forward(model, input_ids: torch.Tensor, cache, *, image_mask=None, routing=None, keep_routing=False):
    """`Transformer.forward(input_ids, cache=cache)`: the logits [B, T, V] fp32 of the new tokens, appended to the
    cache. A first call on a cache whose replay is on trims the decoder to the replay's span (`KVCache`); the rows
    it skips get NaN logits. Returns (logits, state).

    Where the model's kernel switch resolves to Triton (`on_kernels`), the call runs the training forward's kernels
    (`prefill_attention`); their positions are one offset per call, so rows at different lengths then run one at a
    time, and the state returned holds the call's positions only."""
    cfg = model.cfg
    cache.check(model, input_ids)
    bad = (input_ids < 0) | (input_ids >= cfg.vocab_size)
    if bool(bad.any()):
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(f"token id {int(input_ids[b, t])} at row {b}, position {t} is outside the vocabulary "
                         f"[0, {cfg.vocab_size})")
    B, T = input_ids.shape
    first_call = not bool(cache.prefilled.any())
    kernels = on_kernels(model, routing)
    ragged = B > 1 and not bool((cache.lengths == cache.lengths[0]).all())
    kernels = kernels and not (ragged and keep_routing)  # records of one call: its rows at one length
    if kernels and ragged:
        start = cache.lengths.clone()
        logits = torch.cat([_call(model, input_ids[b:b + 1], cache.rows(b, b + 1), first_call, kernels,
                                  None if image_mask is None else image_mask[b:b + 1])[0] for b in range(B)])
        state = ForwardState(positions=start[:, None] + torch.arange(T, device=start.device), phase=cfg.indexer.phase,
                             cache=cache, call_start=start)
    else:
        logits, state = _call(model, input_ids, cache, first_call, kernels, image_mask, routing, keep_routing)
    # a row's first call is its prefill: no rollback goes below its end (KVCache.rollback)
    cache.advance(T)
    cache.prefill_end.copy_(torch.where(cache.prefilled, cache.prefill_end, cache.lengths))
    cache.prefilled.fill_(True)
    return logits, state


def on_kernels(model, routing=None) -> bool:
    """Whether serve_forward runs the training forward's kernels: the attention's kernel switch (model.kernels,
    resolved when the model was placed) is Triton, the indexer is in its sparse phase, the weights are plain tensors
    (no tensor-parallel plan), and no routing record is replayed (the reference path's masks, as in the training
    forward). Records are kept on the kernels too (an RL rollout's prefill): the indexer kernels' top-k ids, as the
    decode kernels keep theirs (`_sorted_ids`), and the MoE's experts; rows at different lengths with records kept
    take the reference path (the kernels run such rows one at a time)."""
    attn = model.layers[0].attn
    return (attn.kernel_path == "triton" and model.cfg.indexer.phase == "sparse" and routing is None
            and kern.plain(attn.wq_a.weight))


def _call(model, input_ids, cache, first_call: bool, kernels: bool, image_mask, routing=None, keep_routing=False):
    """The blocks and the head of serve_forward's call on the rows of `cache` (the counts not yet advanced):
    (logits, state). kernels: every row starts at the same length, and the call runs `prefill_attention`."""
    cfg = model.cfg
    B, T = input_ids.shape
    dev = input_ids.device
    start, positions, engram_in = _append_tokens(model, cache, input_ids, image_mask)
    keep = _kept_rows(cache, model, T) if first_call else T
    state = ForwardState(positions=positions, phase=cfg.indexer.phase, cache=cache, call_start=start,
                         routing=routing, keep_routing=keep_routing)
    if kernels:  # one row of positions, from the rows' common start (as a training forward's, with an offset)
        state.kernel_start = state.offset = int(start[0])
        positions = positions[:1]
        state.positions = positions[0]
    S, pre = embed_streams(model.embed, input_ids, cfg.mhc.num_streams)
    n_enc = cfg.num_encoder_layers
    if keep == T:
        S, pre = forward_blocks(model.layers, S, pre, state, n_enc, engram_in, image_mask)
        return _whole(head_logits(model.norm, model.head, S, pre)), state
    # CED prefill with decoder bounded replay (SPEC 1.5, REFERENCE B1/B3): the encoder on every row, h_{L/2} (the
    # decoder's global KV source) on every row; the first decoder layer on the rows its kept rows' windows read (so
    # it is exact), every later layer on the kept rows alone
    S, pre = forward_blocks(model.layers[:n_enc], S, pre, state, n_enc, engram_in, image_mask)
    state.h_mid = mhc.collapse(S, pre)
    offset = state.offset
    for layers, rows in ((model.layers[n_enc:n_enc + 1], min(T, keep + cfg.attention.window - 1)),
                         (model.layers[n_enc + 1:], keep)):
        S, pre = _slice_rows(S, rows), _slice_rows(pre, rows)
        if kernels:
            state.set_rows(positions[0, T - rows:])
            state.offset = offset + T - rows
        else:
            state.set_rows(positions[:, T - rows:])
        # per-query choices later layers reuse (top-k, pool) follow the rows
        state.selection = {k: _slice_rows(v, rows) for k, v in state.selection.items()}
        state.pool = _slice_rows(state.pool, rows)
        e_in = None if engram_in is None else {k: tuple(_slice_rows(t, rows) for t in v)
                                               for k, v in engram_in.items()}
        S, pre = forward_blocks(layers, S, pre, state, n_enc, e_in, _slice_rows(image_mask, rows))
    logits = torch.full((B, T, cfg.vocab_size), float("nan"), device=dev)
    logits[:, T - keep:] = _whole(head_logits(model.norm, model.head, S, pre))
    return logits, state


def decode_step(model, input_ids: torch.Tensor, cache, kernels: str = "reference", keep_routing: bool = False):
    """One decode token per cache row with static shapes and no host synchronisation: input_ids [B, 1] -> logits
    [B, 1, V] fp32, appended to the cache, as `serve_forward` computes them (to rounding). What changes for a
    CUDA graph to capture it: every KV source presents all `max_len // m` entries of its store, masked by
    visibility (the top-k and the pool depend on the scores alone, not on trailing invisible entries:
    model.csa2.select_topk), entries are written where their group closes without selecting the rows, and the
    checks that read the device (token ids in range, room in the cache, a prefilled cache) are the caller's: the
    engine decodes only tokens it sampled, into rows it sized for the whole request (trainer/engine/engine.py).
    kernels: "reference" (the reference operations) or "triton" (each layer's attention and indexer on the serving
    kernels, model/serving_decode.py: the same logits to fp32 rounding and the same cache contents).
    keep_routing: return (logits, RoutingRecords of the step's choices), static too, as `routing_records` returns
    them after a dynamic step (an RL rollout's records, from a CUDA graph)."""
    if input_ids.dim() != 2 or input_ids.shape != (cache.batch_size, 1):
        raise ValueError(f"decode_step: input_ids must be [{cache.batch_size}, 1], got {tuple(input_ids.shape)}")
    cfg = model.cfg
    if kernels not in DECODE_KERNELS:
        raise ValueError(f"decode_step: kernels must be one of {list(DECODE_KERNELS)}, got {kernels!r}")
    why = check_decode_kernels(cfg) if kernels == "triton" else None  # (the device: the builder's, e.g. Engine)
    if why:
        raise ValueError(f"decode_step(kernels='triton'): {why}")
    start, positions, engram_in = _append_tokens(model, cache, input_ids, None)
    # (the shard passed, not defaulted: torch.compile cannot construct the frozen dataclass)
    state = ForwardState(positions=positions, phase=cfg.indexer.phase, shard=WHOLE, cache=cache, call_start=start,
                         static=True, decode_kernels=kernels, keep_routing=keep_routing)
    S, pre = embed_streams(model.embed, input_ids, cfg.mhc.num_streams)
    S, pre = forward_blocks(model.layers, S, pre, state, cfg.num_encoder_layers, engram_in, None)
    logits = _whole(head_logits(model.norm, model.head, S, pre))
    cache.advance(1)
    return (logits, routing_records(model, state)) if keep_routing else logits


_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def compiled_decode_step(model, backend: str = "inductor", kernels: str = "reference", keep_routing: bool = False):
    """`decode_step` of `model` through torch.compile (fullgraph, static shapes): a callable (input_ids, cache) ->
    logits ((logits, records) with keep_routing). One compiled function per model, backend, kernels and
    keep_routing, kept while the model lives; a cache of other shapes (batch, max_len) compiles again. backend
    "inductor" fuses the step's reference operations into generated kernels; "aot_eager" traces without generating
    code (the CPU tests). kernels: decode_step's."""
    per_model = _COMPILED.setdefault(model, {})
    key = (backend, kernels, keep_routing)
    if key not in per_model:
        per_model[key] = torch.compile(functools.partial(decode_step, model, kernels=kernels, keep_routing=keep_routing),
                                       backend=backend, fullgraph=True, dynamic=False)
    return per_model[key]


def _append_tokens(model, cache, input_ids: torch.Tensor, image_mask):
    """A call's new tokens into the cache's history: (the rows' lengths before the call [B], the new tokens'
    positions [B, T], their Engram row ids)."""
    start = cache.lengths.clone()
    positions = start[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
    cache.tokens.scatter_(1, positions, input_ids)
    return start, positions, _engram_rows(model, cache, input_ids, start, image_mask)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """Logits a tensor-parallel plan returns vocab-sharded (a DTensor), gathered: serving samples from all of them."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def _engram_rows(model, cache, input_ids, start, image_mask):
    """The Engram row ids of the new tokens: each n-gram reaches back max_ngram - 1 tokens into the cache's history
    (positions before 0 count as the sequence start, as in the full forward)."""
    if model.hasher is None:
        return None
    h = model.cfg.engram.max_ngram - 1
    hist_pos = start[:, None] - h + torch.arange(h, device=input_ids.device)  # [B, h]
    hist = cache.tokens.gather(1, hist_pos.clamp(min=0))
    ids = torch.cat((hist, input_ids), dim=1)
    alive = torch.cat((hist_pos >= 0, torch.ones_like(input_ids, dtype=torch.bool)), dim=1)
    img = None
    if image_mask is not None:
        img = torch.cat((torch.zeros_like(hist, dtype=torch.bool), image_mask.bool()), dim=1)
    rows = model.hasher.for_tokens(ids, img, alive)
    return {layer: (r[:, h:], dead[:, h:]) for layer, (r, dead) in rows.items()}


def routing_records(model, state):
    """What a forward with keep_routing chose, as RoutingRecords over the call's rows: rows a trimmed prefill
    skipped in the decoder (they lead the call) hold -1."""
    rec = RoutingRecords()
    k = model.cfg.csa2.index_topk
    for spec in model.plan:
        if spec.owns_indexer and spec.index in state.selection:
            sel = state.selection[spec.index]
            rec.topk[spec.index] = selected_ids(sel, k) if sel.dtype == torch.bool else _sorted_ids(sel, k)
        if spec.index in state.experts:
            rec.experts[spec.index] = state.experts[spec.index]
    lengths = [v.shape[1] for d in (rec.topk, rec.experts) for v in d.values()]
    full = max(lengths, default=0)
    for d in (rec.topk, rec.experts):
        for layer, v in d.items():
            if v.shape[1] < full:
                d[layer] = torch.nn.functional.pad(v, (0, 0, full - v.shape[1], 0), value=-1)
    return rec


def _sorted_ids(ids: torch.Tensor, k: int) -> torch.Tensor:
    """The decode kernels' choice ([B, T, K'] int32 entry ids in pick order, -1 = none: model/serving_decode.py) as
    `selected_ids` records one: ascending, -1 past the chosen, k wide."""
    big = torch.iinfo(torch.int32).max
    ids = torch.where(ids >= 0, ids.to(torch.int32), big).sort(-1).values
    ids = torch.where(ids == big, -1, ids)
    return torch.nn.functional.pad(ids, (0, k - ids.shape[-1]), value=-1) if ids.shape[-1] < k else ids
