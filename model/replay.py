"""Bounded-replay simulation (SPEC 1.5): the training forward computes what serving's bounded replay rebuilds.

Two kinds of cut, each at a position c of a training sequence (W the window):
- "decoder" (serving: a `replay="window"` prefill of a c-token prompt, model/cache.py): the decoder layers after
  the first run on the prompt's last W rows only, so a query at p in [c - W, c) reads window keys from c - W on.
  The first decoder layer, h_{L/2} and the decoder's global KV (projected from it) stay exact, as in serving.
- "encoder" (serving: a prefix-cache hit on c tokens whose SWA state expired, trainer/engine/prefix_cache.py): the
  last W prefix tokens are replayed through every layer, their windows truncated to the replayed span, while the
  global KV of the prefix is the cached one, made by an earlier exact pass. The simulation runs that exact pass
  first (no gradient: an earlier request's computation) and its entries replace the replayed rows' own.

`ReplayCuts` holds one cut per sequence per kind (-1 = none); `window_floors` turns them into, per layer, the first
key position each query's window may read (the attention's truncated window mask, model/attention.py).
`sample_cuts` draws them for a batch from the token ids alone, so a resumed run and every layout draw the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReplayCuts", "window_floors", "sample_cuts"]


@dataclass
class ReplayCuts:
    decoder: torch.Tensor | None = None  # [B] int64 cut position per sequence, -1 = none
    encoder: torch.Tensor | None = None  # [B] int64

    def to(self, device) -> "ReplayCuts":
        return ReplayCuts(*(None if t is None else t.to(device) for t in (self.decoder, self.encoder)))


def _floor(cut: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B] cuts, [T] positions -> [B, T] first readable key position (-1: no truncation)."""
    start = (cut - window).clamp(min=0)[:, None]
    inside = (cut[:, None] >= 0) & (positions[None] >= start) & (positions[None] < cut[:, None])
    return torch.where(inside, start, -1)


def window_floors(cfg, cuts: ReplayCuts, positions: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer: [B, T] first key position each query may read} for the layers a cut truncates."""
    W = cfg.attention.window
    floors: dict[int, torch.Tensor] = {}
    if cuts.encoder is not None and bool((cuts.encoder >= 0).any()):
        enc = _floor(cuts.encoder, positions, W)
        floors = {i: enc for i in range(cfg.num_layers)}
    if cuts.decoder is not None and bool((cuts.decoder >= 0).any()):
        dec = _floor(cuts.decoder, positions, W)
        for i in range(cfg.num_encoder_layers + 1, cfg.num_layers):
            floors[i] = torch.maximum(floors[i], dec) if i in floors else dec
    return floors


def sample_cuts(input_ids: torch.Tensor, window: int, prob: float, kinds: tuple[str, ...], seed: int) -> ReplayCuts:
    """Per sequence and kind, with probability `prob` a cut uniform in [window, T): derived from the sequence's
    token ids and `seed` only (no generator state to checkpoint; the same under every layout and after a resume)."""
    B, T = input_ids.shape
    out = {}
    weights = torch.arange(1, T + 1, dtype=torch.long) * 2654435761
    for k, kind in enumerate(("decoder", "encoder")):
        if kind not in kinds or T <= window:
            continue
        cuts = torch.full((B,), -1, dtype=torch.long)
        for b in range(B):
            key = int((input_ids[b].detach().cpu().long() * weights).sum()) % (2**61 - 1)
            g = torch.Generator().manual_seed((seed * 1_000_003 + key * 31 + k) % (2**63 - 1))
            if float(torch.rand((), generator=g)) < prob:
                cuts[b] = int(torch.randint(window, T, (), generator=g))
        out[kind] = cuts.to(input_ids.device)
    return ReplayCuts(**out)
