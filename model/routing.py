"""Routing records: what a rollout chose, so training can replay it (RL's "rollout routing replay", R3, and index
replay).

Per token of a sequence: every index source's top-k entry ids ([B, T, K] int32, increasing, -1 past the chosen ones)
and every MoE layer's experts ([B, T, K_e] int64). The engine (trainer/engine/) returns them with a rollout; the
training forward takes them (`model(ids, routing=records)`) and uses them instead of choosing, so its log-probs of
the rollout are the engine's: a tiny numeric difference between the two forwards can no longer flip a top-k or an
expert choice. A row the record does not cover (a decoder row a bounded-replay prefill skipped) holds -1 and is
chosen by the forward itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.csa2 import ids_to_selection

__all__ = ["RoutingRecords", "forced_selection"]


@dataclass
class RoutingRecords:
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [B, T, K] int32 entry ids
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [B, T, K_e] int64

    @staticmethod
    def cat(parts: list["RoutingRecords"], dim: int = 1) -> "RoutingRecords":
        """Join records along the tokens (dim=1: a prompt's then each decode step's) or the batch (dim=0); top-k
        records of different widths (fewer entries than K early on) are padded with -1."""
        def join(key: str) -> dict[int, torch.Tensor]:
            out = {}
            for layer in getattr(parts[0], key):
                ts = [getattr(p, key)[layer] for p in parts]
                width = max(t.shape[-1] for t in ts)
                ts = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1) for t in ts]
                out[layer] = torch.cat(ts, dim=dim)
            return out

        return RoutingRecords(join("topk"), join("experts"))

    def to(self, device) -> "RoutingRecords":
        return RoutingRecords({k: v.to(device) for k, v in self.topk.items()},
                              {k: v.to(device) for k, v in self.experts.items()})

    def rows(self, i: int, j: int) -> "RoutingRecords":
        return RoutingRecords({k: v[i:j] for k, v in self.topk.items()}, {k: v[i:j] for k, v in self.experts.items()})

    def tokens(self, i: int, j: int) -> "RoutingRecords":
        return RoutingRecords({k: v[:, i:j] for k, v in self.topk.items()},
                              {k: v[:, i:j] for k, v in self.experts.items()})

    def _rows_at(self, t: torch.Tensor, state) -> torch.Tensor | None:
        """The record's rows at the state's query positions ([T] or [B, T]), -1 where the record ends."""
        pos = state.positions
        if pos.dim() == 1:
            pos = pos[None].expand(t.shape[0], -1)
        inside = pos < t.shape[1]
        rows = t.gather(1, pos.clamp(max=t.shape[1] - 1)[..., None].expand(-1, -1, t.shape[-1]).long())
        return torch.where(inside[..., None], rows, torch.full_like(rows, -1))

    def topk_rows(self, layer: int, state) -> torch.Tensor | None:
        return self._rows_at(self.topk[layer], state) if layer in self.topk else None

    def expert_rows(self, layer: int, state) -> torch.Tensor | None:
        return self._rows_at(self.experts[layer], state) if layer in self.experts else None


def forced_selection(state, layer: int, selection: torch.Tensor) -> torch.Tensor:
    """The recorded top-k of index source `layer` where state.routing has one for the row (a row of -1 has none),
    else `selection` ([B, T, E] bool)."""
    routing = state.routing
    ids = None if routing is None else routing.topk_rows(layer, state)
    if ids is None:
        return selection
    has = (ids >= 0).any(-1, keepdim=True)
    return torch.where(has, ids_to_selection(ids, selection.shape[-1]), selection)
