"""The inference cache: what serving keeps per request between forwards (SPEC 1.4-1.5, REFERENCE B2).

Contract: `KVCache` holds one `LayerCache` per layer: Full (KV-source) layers keep the persistent global KV (main KV
and indexer keys of every compressed entry, `max_len // m` per request) and, for ratio m > 1, a ring of the
compressor's fp32 projections of the last m - 1 + k tokens; every layer keeps its SWA KV in a ring of window + k
rows (k = `spec_tokens`, 0 by default: the plain cache). `KVCache.rollback` takes back rejected speculative tokens
(at most k per rollback). `Store` keeps a buffer in one of `STORE_FORMATS`; with the forward fake-quantising in
the store's format, what it dequantises is bit for bit what the training forward used. Per request the cache
tracks `lengths`, `swa_start`, `entries`, the token ids, `reached` and `prefill_end`. `KVCache.rows(i, j)` is a
view of requests i..j-1 sharing the buffers. `CacheError`: a cache that does not fit the call (another model,
`model_fingerprint`; another batch size, too short, bad rows).

Design and reasoning: docs/model.md#inference-cache
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from kernels import fp4, fp8

__all__ = ["Store", "LayerCache", "KVCache", "CacheError", "STORE_FORMATS", "model_fingerprint"]

# the storage formats a Store takes (model.quant.cache_*; "fp4_ue8m0" is cache_index's "fp4")
STORE_FORMATS = ("none", "bf16", "fp8", "fp4", "fp4_ue8m0")
_FP4_SCALE = {"fp4": (16, "e4m3"), "fp4_ue8m0": (32, "ue8m0")}


class CacheError(ValueError):
    """A cache that does not fit the call: another model or batch size, too short, bad rows."""


def model_fingerprint(cfg) -> str:
    """A short hash of a model config: a cache is only valid for the model config it was made for."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# the byte of a scale of 1 (what a row holds before it is written): E4M3 0x38, UE8M0 127
_ONE = {torch.float8_e4m3fn: 0x38, torch.float8_e8m0fnu: 127}


def _layout(fmt: str, dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype, int]]:
    """A format's buffers: (channels, dtype, the raw fill of an unwritten row) each."""
    if fmt == "none":
        return [(dim, dtype, 0)]
    if fmt == "bf16":
        return [(dim, torch.bfloat16, 0)]
    if fmt == "fp8":
        return [(dim, torch.float8_e4m3fn, 0), (dim // 32, torch.float8_e8m0fnu, _ONE[torch.float8_e8m0fnu])]
    block, scale_fmt = _FP4_SCALE[fmt]
    scale = torch.float8_e4m3fn if scale_fmt == "e4m3" else torch.float8_e8m0fnu
    return [(dim // 2, torch.uint8, 0), (dim // block, scale, _ONE[scale])]


class Store:
    """Rows of D channels in one storage format: logically [B, N, D], physically the format's buffers."""

    def __init__(self, fmt: str, batch: int, rows: int, dim: int, dtype: torch.dtype, device, *, buffers=None):
        if fmt not in STORE_FORMATS:
            raise ValueError(f"cache storage format must be one of {list(STORE_FORMATS)}, got {fmt!r}")
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        if buffers is not None:
            self.buffers = buffers
            return
        self.buffers = tuple(_bytes(torch.empty(batch, rows, n, dtype=dt, device=device)).fill_(fill).view(dt)
                             for n, dt, fill in _layout(fmt, dim, dtype))

    def rows(self, i: int, j: int) -> "Store":
        """Rows i..j-1 of every buffer (views: writes land here)."""
        return Store(self.fmt, 0, 0, self.dim, self.dtype, None, buffers=tuple(b[i:j] for b in self.buffers))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def encode(self, value: torch.Tensor, pre: torch.Tensor | None, pre_fmt: str | None) -> tuple:
        """value [..., D]: what the forward computed; pre: the same before its fake-quant, pre_fmt that fake-quant's
        format (None: no fake-quant). Returns the stored parts."""
        src = pre if (pre is not None and pre_fmt == self.fmt) else value
        if self.fmt == "none":
            return (value.to(self.dtype),)
        if self.fmt == "bf16":
            return (value.to(torch.bfloat16),)
        if self.fmt == "fp8":
            return fp8.quantize_fp8(src, 32)
        block, scale_fmt = _FP4_SCALE[self.fmt]
        return fp4.quantize(src, block, scale_fmt)

    def decode(self, parts: tuple, impl: str = "reference") -> torch.Tensor:
        """Stored parts [..., *] -> values [..., D] in the compute dtype. impl "triton": the dequantisers' Triton
        kernels (bit-exact against the reference; they take contiguous parts)."""
        if self.fmt in ("none", "bf16"):
            return parts[0].to(self.dtype)
        if impl == "triton":
            parts = tuple(p.contiguous() for p in parts)
        if self.fmt == "fp8":
            return fp8.dequantize_fp8(parts[0], parts[1], 32, impl=impl).to(self.dtype)
        return fp4.dequantize(parts[0], parts[1], _FP4_SCALE[self.fmt][0], impl=impl).to(self.dtype)

    def write(self, batch_idx: torch.Tensor, row_idx: torch.Tensor, parts: tuple) -> None:
        """Store parts[k][n] at (batch_idx[n], row_idx[n]) for the n selected rows (parts: [n, ...])."""
        for buf, part in zip(self.buffers, parts):
            _bytes(buf)[batch_idx, row_idx] = _bytes(part.to(buf.dtype))

    def write_where(self, mask: torch.Tensor, idx: torch.Tensor, parts: tuple) -> None:
        """Store parts[k][b, g] at row idx[b, g] of request b where mask[b, g], leaving the old bytes elsewhere
        (parts: [B, G, ...]; idx [B, G] in range, distinct where the mask is set): static shapes, for a captured
        step (`write` takes the selected rows instead)."""
        b = torch.arange(idx.shape[0], device=idx.device)[:, None]
        for buf, part in zip(self.buffers, parts):
            raw = _bytes(buf)
            new = _bytes(part.to(buf.dtype))
            keep = mask.view(*mask.shape, *([1] * (new.dim() - mask.dim())))
            raw[b, idx] = torch.where(keep, new, raw[b, idx])

    def clear(self, batch_idx: torch.Tensor | None = None, row_idx: torch.Tensor | None = None) -> None:
        """The rows (batch_idx[n], row_idx[n]) back to a new store's bytes; every row when none are given."""
        where = (...,) if batch_idx is None else (batch_idx, row_idx)
        for buf, (_, _, fill) in zip(self.buffers, _layout(self.fmt, self.dim, self.dtype)):
            _bytes(buf)[where] = fill

    def read(self, idx: torch.Tensor, impl: str = "reference") -> torch.Tensor:
        """idx [B, K] row indices (in range) -> [B, K, D] decoded (impl: `decode`'s)."""
        b = torch.arange(idx.shape[0], device=idx.device)[:, None]
        return self.decode(tuple(_bytes(buf)[b, idx.long()].view(buf.dtype) for buf in self.buffers), impl)

    def read_prefix(self, n: int, impl: str = "reference") -> torch.Tensor:
        """The first n rows of every request, decoded: [B, n, D] (impl: `decode`'s)."""
        return self.decode(tuple(buf[:, :n] for buf in self.buffers), impl)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float (float8) tensor as uint8, so indexing runs on every device; others unchanged."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t


@dataclasses.dataclass
class LayerCache:
    """One layer's part of the cache (see docs/model.md#inference-cache)."""

    swa: Store  # [B, R, D] ring, position p at slot p % R
    main: Store | None = None  # Full layers: [B, max_len // m, D]
    keys: Store | None = None  # Full layers: [B, max_len // m, Di]
    # Full layers with m > 1: [B, C, 2, D] fp32 (kv, gate) of the last C tokens, position p at slot p % C: the open
    # group's rows (and, with a speculation headroom, those a rollback reopens)
    pending: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # Full layers: [B] int64 global entries stored
    ratio: int = 0  # Full layers: the compression ratio m

    def rows(self, i: int, j: int) -> "LayerCache":
        return LayerCache(self.swa.rows(i, j), None if self.main is None else self.main.rows(i, j),
                          None if self.keys is None else self.keys.rows(i, j),
                          None if self.pending is None else self.pending[i:j],
                          None if self.entries is None else self.entries[i:j], self.ratio)


class KVCache:
    """The cache of `batch_size` requests of up to `max_len` tokens each (model.transformer.Transformer.new_cache).

    replay: how the first forward on a request (its prefill) builds the decoder's SWA state (SPEC 1.5, REFERENCE
    B1): "none" runs every prompt row through every layer; "window" runs the decoder (after its first layer, which
    stays exact) on the prompt's last `window` rows only (vLLM's "last window rows", the report's serving path: an
    approximation the model learns to tolerate with the `bounded_replay_sim` hook); "halo" keeps the last
    W + (n - 1)(W - 1) rows, n the decoder layers after the first, enough that every layer's last W rows and the last
    row's logits are exact (vLLM's "exact halo"). Rows the decoder skipped get NaN logits.

    spec_tokens: the speculation headroom k, the most tokens a `rollback` takes back (a verify forward's drafts): the
    SWA rings get W + k rows and the compressor rings m - 1 + k (docs/model.md); 0 is the plain cache.
    """

    REPLAYS = ("none", "window", "halo")

    def __init__(self, model, batch_size: int, max_len: int, replay: str = "halo", *, dtype=None, device=None,
                 spec_tokens: int = 0):
        cfg = model.cfg
        self.cfg = cfg
        self.fingerprint = model_fingerprint(cfg)
        self.replay = replay
        if replay not in self.REPLAYS:
            raise CacheError(f"new_cache: replay must be one of {list(self.REPLAYS)}, got {replay!r}")
        if batch_size < 1 or max_len < 1:
            raise CacheError(f"new_cache: batch_size and max_len must be >= 1, got {batch_size} and {max_len}")
        if not isinstance(spec_tokens, int) or spec_tokens < 0:
            raise CacheError(f"new_cache: spec_tokens must be an int >= 0, got {spec_tokens!r}")
        self.spec_tokens = k = spec_tokens
        weight = model.embed.weight
        dtype = dtype or weight.dtype
        device = device or weight.device
        self.batch_size, self.max_len = batch_size, max_len
        a, c, q = cfg.attention, cfg.csa2, cfg.quant
        index_fmt = "fp4_ue8m0" if q.cache_index == "fp4" else q.cache_index
        self.layers: dict[int, LayerCache] = {}
        for spec in model.plan:
            lc = LayerCache(Store(q.cache_swa_kv, batch_size, a.window + k, a.head_dim, dtype, device))
            if spec.owns_kv:
                n = max_len // spec.ratio
                lc.main = Store(q.cache_main_kv, batch_size, n, a.head_dim, dtype, device)
                lc.keys = Store(index_fmt, batch_size, n, c.index_head_dim, dtype, device)
                lc.entries = torch.zeros(batch_size, dtype=torch.long, device=device)
                lc.ratio = spec.ratio
                if spec.ratio > 1:
                    lc.pending = torch.zeros(batch_size, spec.ratio - 1 + k, 2, a.head_dim, dtype=torch.float32,
                                             device=device)
            self.layers[spec.index] = lc
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.swa_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.prefilled = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.reached = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.prefill_end = torch.zeros(batch_size, dtype=torch.long, device=device)

    # -- views and bookkeeping -----------------------------------------------------------------------------------
    def rows(self, i: int, j: int) -> "KVCache":
        """Requests i..j-1 as a cache of their own that shares this one's buffers (writes land here)."""
        if not 0 <= i < j <= self.batch_size:
            raise CacheError(f"cache rows [{i}, {j}) are outside the cache's {self.batch_size} rows")
        out = KVCache.__new__(KVCache)  # the same fields, each a slice of this cache's
        out.cfg, out.fingerprint, out.replay, out.max_len = self.cfg, self.fingerprint, self.replay, self.max_len
        out.spec_tokens = self.spec_tokens
        out.batch_size, out.layers = j - i, {k: v.rows(i, j) for k, v in self.layers.items()}
        out.lengths, out.swa_start = self.lengths[i:j], self.swa_start[i:j]
        out.tokens, out.prefilled = self.tokens[i:j], self.prefilled[i:j]
        out.reached, out.prefill_end = self.reached[i:j], self.prefill_end[i:j]
        return out

    def reset(self) -> None:
        """Forget every request (the buffers stay allocated)."""
        self.lengths.zero_()
        self.swa_start.zero_()
        self.prefilled.zero_()
        self.reached.zero_()
        self.prefill_end.zero_()
        for lc in self.layers.values():
            if lc.entries is not None:
                lc.entries.zero_()

    def clear(self) -> None:
        """Forget every request and restore every buffer to what `new_cache` put there, in place: the cache is then
        a new one (the same shapes and buffer addresses: a CUDA graph captured on it stays valid; the engine's graph
        pool reuses caches this way, trainer/engine/engine.py)."""
        self.reset()
        for lc in self.layers.values():
            for store in (lc.swa, lc.main, lc.keys):
                if store is not None:
                    store.clear()
            if lc.pending is not None:
                lc.pending.zero_()
        self.tokens.zero_()

    def advance(self, n: int) -> None:
        """Count n tokens appended to every row (the forward has written them): static, a captured step runs it."""
        self.lengths += n
        self.reached.copy_(torch.maximum(self.reached, self.lengths))

    def rollback(self, lengths) -> None:
        """Take back each row's last tokens: lengths [B] (a LongTensor or a list) the rows' new lengths, between
        `reached - spec_tokens` (and the row's prefill end and swa_start) and the current length. Afterwards the
        cache is what appending only each row's first lengths[b] tokens would have made: the counts, the token
        history and the global entries (those the rejected tokens closed blanked, as a new cache has them); the
        rings' rows the kept tokens need are still there (their slots are positions'), and the rejected tokens'
        slots are never read (the next call writes its positions before any read of them). In place: a captured
        decode step (trainer/engine/engine.py's _DecodeGraph) keeps decoding the same buffers."""
        new = torch.as_tensor(lengths, dtype=torch.long).to(self.lengths.device)
        if new.shape != (self.batch_size,):
            raise CacheError(f"rollback: lengths of shape {tuple(new.shape)} do not fit a cache of batch size "
                             f"{self.batch_size}: pass [{self.batch_size}]")
        k = self.spec_tokens
        above = (new > self.lengths).nonzero().flatten().tolist()
        if above:
            b = above[0]
            raise CacheError(f"rollback: cache row {b} holds {int(self.lengths[b])} tokens: it cannot roll forward to "
                             f"{int(new[b])}")
        floors = ((self.reached - k, lambda b: f"it has reached {int(self.reached[b])} tokens and the cache's "
                   f"speculation headroom is spec_tokens={k} (a cache made by new_cache(..., spec_tokens=k) takes "
                   f"back up to k tokens from the longest a row has been)"),
                  (self.prefill_end, lambda b: f"its prefill ended at {int(self.prefill_end[b])} tokens (a rollback "
                   f"takes back only tokens appended after it)"),
                  (self.swa_start, lambda b: f"its SWA rows start at position {int(self.swa_start[b])}"))
        for floor, why in floors:
            below = (new < floor).nonzero().flatten().tolist()
            if below:
                b = below[0]
                raise CacheError(f"rollback: cache row {b} cannot go back to {int(new[b])} tokens (below "
                                 f"{int(floor[b])}): {why(b)}")
        old = self.lengths.clone()
        for lc in self.layers.values():
            if lc.entries is None:
                continue
            m = lc.ratio
            # the entries the taken-back tokens closed: ids [new // m, old // m), at most k // m + 1 of them
            kept = torch.where(new < old, torch.minimum(lc.entries, new // m), lc.entries)
            ids = kept[:, None] + torch.arange(k // m + 1, device=new.device)
            b, g = (ids < lc.entries[:, None]).nonzero(as_tuple=True)
            lc.main.clear(b, ids[b, g])
            lc.keys.clear(b, ids[b, g])
            lc.entries.copy_(kept)
        pos = torch.arange(self.max_len, device=new.device)[None]
        self.tokens.masked_fill_((pos >= new[:, None]) & (pos < old[:, None]), 0)
        self.lengths.copy_(new)

    def nbytes(self, persistent: bool | None = None) -> int:
        """Bytes of the allocated buffers: persistent=True the global KV (main KV + indexer keys, what a prefix
        cache keeps), False the short-lived state (SWA rings, compressor rings: with spec_tokens > 0 their headroom
        rows too), None all of it."""
        total = 0
        for lc in self.layers.values():
            glob = sum(s.nbytes() for s in (lc.main, lc.keys) if s is not None)
            short = lc.swa.nbytes() + (0 if lc.pending is None else lc.pending.numel() * 4)
            total += glob if persistent else short if persistent is False else glob + short
        return total

    def check(self, model, input_ids: torch.Tensor) -> None:
        """One-line errors for a call that does not fit: another model, batch size, too many tokens."""
        if self.fingerprint != model_fingerprint(model.cfg):
            raise CacheError(f"this cache was made for another model config (model {self.cfg.name!r}, fingerprint "
                             f"{self.fingerprint}); make one with this model's new_cache")
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise CacheError(f"input_ids of shape {tuple(input_ids.shape)} do not fit a cache of batch size "
                             f"{self.batch_size}: pass [{self.batch_size}, T]")
        if input_ids.shape[1] == 0:
            raise CacheError("input_ids has no tokens (an empty prompt)")
        room = self.max_len - self.lengths
        over = (room < input_ids.shape[1]).nonzero().flatten().tolist()
        if over:
            b = over[0]
            raise CacheError(f"cache row {b} holds {int(self.lengths[b])} of max_len={self.max_len} tokens: "
                             f"{input_ids.shape[1]} more do not fit")
