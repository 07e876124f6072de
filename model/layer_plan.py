"""The layer plan: each layer's static attention role, derived from the config and validated once.

Roles (SPEC 1.2, REFERENCE A5):
- ``swa``: window attention only (compression ratio 0).
- ``full``: owns a compressor (main KV) and indexer keys, scores every visible entry, picks its own top-k.
  In the decoder the compressor reads h_{L/2} (the encoder's output), not the layer's own stream (CED).
- ``reindex``: reuses the nearest Full layer's main KV and indexer keys, runs its own indexer queries and
  top-k; when the hierarchical pool is on it searches only the pool built by the candidate source.
- ``reuse``: reuses the nearest Full layer's main KV and the nearest Full/Reindex layer's top-k; no indexer.

An impossible plan fails here, at config time, with a ValueError naming the layer and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    index: int
    is_decoder: bool
    role: str  # "swa" | "full" | "reindex" | "reuse"
    ratio: int  # 0 = SWA only
    kv_source: int | None  # layer whose compressor makes this layer's main KV (itself for Full)
    index_source: int | None  # layer whose top-k this layer uses (itself for Full/Reindex)
    builds_pool: bool  # this Full layer publishes the hierarchical candidate pool
    uses_pool: bool  # this Reindex layer restricts its search to the pool
    engram: bool
    rope: str  # "main" (theta 1e4) or "compress" (YaRN'd theta), per REFERENCE A1

    @property
    def owns_kv(self) -> bool:
        return self.role == "full"

    @property
    def owns_indexer(self) -> bool:
        return self.role in ("full", "reindex")

    @property
    def kv_input(self) -> str:
        """What the compressor of a Full layer reads: its own attention input, or h_{L/2} (CED)."""
        return "h_mid" if self.is_decoder else "self"


def _fail(layer: int, rule: str) -> None:
    raise ValueError(f"layer plan: layer {layer}: {rule}")


def build_layer_plan(cfg: ModelConfig) -> list[LayerSpec]:
    c = cfg.csa2
    n = cfg.num_layers
    ratios = list(c.compress_ratios)
    if len(ratios) != n:
        raise ValueError(f"layer plan: compress_ratios has {len(ratios)} entries for {n} layers")
    kv_sources, index_sources = set(c.kv_source_layers), set(c.index_source_layers)
    for name, layers in (("kv_source_layers", kv_sources), ("index_source_layers", index_sources)):
        for i in sorted(layers):
            if not 0 <= i < n:
                _fail(i, f"csa2.{name} names a layer outside [0, {n})")
            if ratios[i] == 0:
                _fail(i, f"csa2.{name} names an SWA-only layer (compress ratio 0); sources need ratio > 0")
    for i in sorted(kv_sources - index_sources):
        _fail(i, "a KV source (Full layer) must also be an index source: Full layers pick their own top-k")
    for i in cfg.engram.layers:
        if not 0 <= i < n:
            _fail(i, f"engram.layers names a layer outside [0, {n})")
    if len(set(cfg.engram.layers)) != len(cfg.engram.layers):
        raise ValueError(f"layer plan: engram.layers has duplicates: {list(cfg.engram.layers)}")

    pool_src = c.candidate_source_layer if c.hierarchical_pool else -1
    if c.hierarchical_pool:
        if pool_src not in kv_sources:
            _fail(pool_src, "csa2.candidate_source_layer must be a Full layer (a KV source) "
                            "when hierarchical_pool is on")
        pool = c.candidate_topk_blocks * c.candidate_block_size
        if c.index_topk > pool:
            _fail(pool_src, f"index_topk={c.index_topk} exceeds the candidate pool "
                            f"({c.candidate_topk_blocks} blocks x {c.candidate_block_size} = {pool} entries)")
        bs = c.candidate_block_size
        if bs & (bs - 1) or 64 % bs:
            _fail(pool_src, f"candidate_block_size={bs} must be a power of two dividing 64 "
                            "(the indexer kernel's entry tile)")

    plan: list[LayerSpec] = []
    last_kv: int | None = None
    last_index: int | None = None
    for i in range(n):
        is_dec = i >= cfg.num_encoder_layers
        r = ratios[i]
        if i in kv_sources:
            last_kv = i
        if i in index_sources:
            last_index = i
        if r == 0:
            role, kv_src, idx_src = "swa", None, None
        else:
            if last_kv is None:
                _fail(i, "compressed layer has no KV source (Full layer) at or below it")
            if ratios[last_kv] != r:
                _fail(i, f"compress ratio {r} differs from its KV source layer {last_kv} (ratio "
                         f"{ratios[last_kv]}): entries would be misaligned")
            if is_dec and last_kv < cfg.num_encoder_layers:
                _fail(i, f"decoder layer takes global KV from encoder layer {last_kv}; the decoder's "
                         "global KV must come from a decoder Full layer reading h_{L/2}")
            if not is_dec and last_kv >= cfg.num_encoder_layers:  # unreachable with sources below; kept
                _fail(i, "encoder layer sources from the decoder")
            if last_index is None or last_index < last_kv:
                _fail(i, f"no index source between its KV source {last_kv} and itself: its top-k "
                         "would index another layer's entries")
            kv_src, idx_src = last_kv, last_index
            role = "full" if i in kv_sources else "reindex" if i in index_sources else "reuse"
        uses_pool = role == "reindex" and pool_src >= 0 and kv_src == pool_src
        plan.append(LayerSpec(
            index=i, is_decoder=is_dec, role=role, ratio=r, kv_source=kv_src, index_source=idx_src,
            builds_pool=(i == pool_src), uses_pool=uses_pool, engram=i in cfg.engram.layers,
            rope="main" if r == 0 else "compress",
        ))
    return plan


def describe(plan: list[LayerSpec]) -> str:
    """One line per layer, for logs and the planner."""
    rows = []
    for s in plan:
        extra = []
        if s.kv_source is not None and s.role != "full":
            extra.append(f"kv<-{s.kv_source}")
        if s.index_source is not None and s.role == "reuse":
            extra.append(f"topk<-{s.index_source}")
        if s.builds_pool:
            extra.append("builds pool")
        if s.uses_pool:
            extra.append("pool-restricted")
        if s.role == "full" and s.is_decoder:
            extra.append("kv from h_mid")
        if s.engram:
            extra.append("engram")
        part = "dec" if s.is_decoder else "enc"
        rows.append(f"{s.index:3d} {part} {s.role:7s} m={s.ratio} {' '.join(extra)}")
    return "\n".join(rows)
