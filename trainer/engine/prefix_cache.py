"""Prefix cache: a request whose prompt starts with blocks seen before reuses their global KV (SPEC 1.5, REFERENCE
B1 1a and B2).

Contract: `PrefixCache` keys token blocks by a hash of the whole prefix up to each block's end; it keeps every KV
source's stored entries per block (LRU past `max_blocks`) and at a prompt's last block boundary the SWA rings (for
`swa_ttl_s` seconds). A lookup takes the longest run of cached blocks, leaving at least the prompt's last token to
compute; with the SWA state expired the last `window` hit tokens are replayed (encoder bounded replay) with the
cached global KV kept. Blocks are multiples of every compression ratio. `stats` counts lookups, hits, misses, SWA
hits, replays and evictions.

Design and reasoning: docs/generation.md#prefix-cache
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Callable

import torch

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, model, *, block_size: int = 16, max_blocks: int = 65536, swa_ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        ratios = {s.ratio for s in model.plan if s.ratio > 0}
        bad = [m for m in ratios if block_size % m]
        if block_size < 1 or bad:
            raise ValueError(f"prefix cache: block_size={block_size} must be a multiple of every compression ratio "
                             f"({sorted(ratios)})")
        self.block_size, self.max_blocks, self.swa_ttl_s, self.clock = block_size, max_blocks, swa_ttl_s, clock
        self.window = model.cfg.attention.window
        self.sources = {s.index: s.ratio for s in model.plan if s.owns_kv}
        self.blocks: OrderedDict[bytes, dict] = OrderedDict()
        self.swa: dict[bytes, tuple[float, int, dict]] = {}
        self.stats = dict(lookups=0, hits=0, misses=0, swa_hits=0, replays=0, evictions=0)

    def _keys(self, ids: list[int], n_blocks: int) -> list[bytes]:
        keys, prev = [], b""
        bs = self.block_size
        for i in range(n_blocks):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(torch.tensor(ids[i * bs:(i + 1) * bs], dtype=torch.int64).numpy().tobytes())
            prev = h.digest()
            keys.append(prev)
        return keys

    def boundary(self, n: int) -> int:
        """The last block boundary before the prompt's end (at least one token stays to compute)."""
        return (n - 1) // self.block_size * self.block_size

    # -- lookup --------------------------------------------------------------------------------------------------
    def restore(self, cache, ids: list[int]) -> int:
        """Fill a one-row cache with the longest cached prefix of `ids`; returns the position to feed tokens from."""
        self.stats["lookups"] += 1
        n_blocks = self.boundary(len(ids)) // self.block_size
        keys = self._keys(ids, n_blocks)
        hit = 0
        while hit < n_blocks and keys[hit] in self.blocks:
            hit += 1
        self.stats["hits"] += hit
        self.stats["misses"] += n_blocks - hit
        if hit == 0:
            return 0
        H = hit * self.block_size
        bs = self.block_size
        for i in range(hit):
            self.blocks.move_to_end(keys[i])
            for src, parts in self.blocks[keys[i]].items():
                lc, m = cache.layers[src], self.sources[src]
                rows = slice(i * bs // m, (i + 1) * bs // m)
                for store, stored in ((lc.main, parts[0]), (lc.keys, parts[1])):
                    for buf, p in zip(store.buffers, stored):
                        buf[0, rows] = p
        for src, m in self.sources.items():
            cache.layers[src].entries.fill_(H // m)
        cache.tokens[0, :H] = torch.tensor(ids[:H], device=cache.tokens.device)
        cache.prefilled.fill_(False)
        swa = self.swa.get(keys[hit - 1])
        if swa is not None and self.clock() - swa[0] > self.swa_ttl_s:
            del self.swa[keys[hit - 1]]
            swa = None
        if swa is not None:
            self.stats["swa_hits"] += 1
            _, swa_start, rings = swa
            for layer, parts in rings.items():
                for buf, p in zip(cache.layers[layer].swa.buffers, parts):
                    buf[0] = p
            cache.lengths.fill_(H)
            cache.swa_start.fill_(swa_start)
            return H
        self.stats["replays"] += 1
        start = H - min(self.window, H)
        cache.lengths.fill_(start)
        cache.swa_start.fill_(start)
        return start

    def insert(self, cache, ids: list[int], upto: int) -> None:
        """Keep a one-row cache's global KV of the blocks before `upto` (a block boundary it has just reached) and
        its SWA state there."""
        if upto <= 0:
            return
        bs = self.block_size
        keys = self._keys(ids, upto // bs)
        for i, key in enumerate(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            entry = {}
            for src, m in self.sources.items():
                lc = cache.layers[src]
                rows = slice(i * bs // m, (i + 1) * bs // m)
                entry[src] = tuple(tuple(buf[0, rows].clone() for buf in store.buffers)
                                   for store in (lc.main, lc.keys))
            self.blocks[key] = entry
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)
                self.stats["evictions"] += 1
        rings = {layer: tuple(buf[0].clone() for buf in lc.swa.buffers) for layer, lc in cache.layers.items()}
        self.swa[keys[-1]] = (self.clock(), int(cache.swa_start[0]), rings)

    def expire_swa(self) -> None:
        """Drop every SWA state (as if the TTL had passed for all)."""
        self.swa.clear()
