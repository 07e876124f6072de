"""Speculative decoding in the built-in engine (issue 19): DSpark (model/dspark.py) drafts, the backbone verifies
the block in one forward, the standard rule keeps a prefix of the drafts (trainer/engine/speculative.py), and the
cache rolls back past the rest (`KVCache.rollback`). `Engine(model, drafter=..., spec_tokens=k)` decodes this way.

Contract: `SpecDecoder` runs the steps for a batch of cache rows: the tokens emitted are exactly the backbone's
greedy tokens (temperature 0) or distributed exactly as its samples, each with its log-probs from the backbone's
distribution of its slot, never past a stop token or max_new_tokens. The cache is made with spec_tokens = K + 1
(`cache_tokens`). `ContextRing` keeps each row's last W positions of the drafter's context (the stream means of its
target layers). Not here: CUDA graphs, R3 routing records, several processes (the engine refuses them).

Design and reasoning: docs/generation.md#speculative-decoding-step-by-step
"""

from __future__ import annotations

import dataclasses
import time

import torch

from model.dspark import stream_means
from trainer.engine.sampling import sampling_logprobs
from trainer.engine.speculative import SCHEDULES, SpecScheduler, ThroughputCurve, accept_greedy, accept_sampled

__all__ = ["SpecDecoder", "ContextRing"]

# the backbone fields a drafter's config must share with the engine's model (its blocks, heads and context use them)
_SHARED_FIELDS = ("vocab_size", "dim", "num_layers")


class ContextRing:
    """Per cache row, the drafter's context main_x of the last W positions written: position p at slot p % W, with
    the position each slot holds (-1: none), so a window reads only the positions it asks for."""

    def __init__(self, batch: int, window: int, dim: int, dtype: torch.dtype, device):
        self.window = window
        self.x = torch.zeros(batch, window, dim, dtype=dtype, device=device)  # [B, W, dim]
        self.pos = torch.full((batch, window), -1, dtype=torch.long, device=device)  # [B, W]

    def write(self, rows: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, keep: torch.Tensor) -> None:
        """Rows `rows` [R] of the ring get ctx [R, T, dim] at positions [R, T] where keep [R, T] (per row only its
        last W kept positions: the earlier ones' slots are theirs)."""
        W = self.window
        last = torch.where(keep, positions, -1).amax(dim=1, keepdim=True)  # [R, 1]
        r, t = (keep & (positions > last - W)).nonzero(as_tuple=True)
        p = positions[r, t]
        self.x[rows[r], p % W] = ctx[r, t].to(self.x.dtype)
        self.pos[rows[r], p % W] = p

    def window_at(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """anchors [B] -> (ctx [B, W, dim] at positions anchors - W .. anchors - 1, visible [B, W])."""
        want = anchors[:, None] - self.window + torch.arange(self.window, device=anchors.device)  # [B, W]
        slot = want % self.window
        ctx = self.x.gather(1, slot[..., None].expand(-1, -1, self.x.shape[-1]))
        return ctx, (self.pos.gather(1, slot) == want) & (want >= 0)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpecDecoder:
    """The engine's speculative decode loop for one model and drafter
    (docs/generation.md#speculative-decoding-step-by-step). spec_tokens: K, None = the drafter's block_size; schedule
    "fixed" (always K) or "auto". The scheduler (its calibration of the confidences, its back-off) and `curve`, the
    measured costs ("auto" measures t(k) on a scratch cache the first time it meets a batch size, then every step), live
    as long as the engine: what one batch learnt serves the next."""

    def __init__(self, model, drafter, spec_tokens: int | None = None, schedule: str = "fixed"):
        cfg, dcfg = model.cfg, getattr(drafter, "cfg", None)
        if not hasattr(drafter, "draft_hidden") or dcfg is None:
            raise ValueError(f"Engine(drafter=...) takes a model.dspark.DSpark, got {type(drafter).__name__}")
        for name in _SHARED_FIELDS:
            if getattr(dcfg, name) != getattr(cfg, name):
                raise ValueError(f"the drafter was built for another backbone: its model.{name}="
                                 f"{getattr(dcfg, name)!r}, the engine's model has {getattr(cfg, name)!r}")
        if dcfg.mhc.num_streams != cfg.mhc.num_streams:
            raise ValueError(f"the drafter was built for another backbone: its model.mhc.num_streams="
                             f"{dcfg.mhc.num_streams}, the engine's model has {cfg.mhc.num_streams}")
        if dataclasses.asdict(dcfg.dspark) != dataclasses.asdict(cfg.dspark):
            raise ValueError(f"the drafter's model.dspark ({dcfg.dspark}) differs from the engine's model's "
                             f"({cfg.dspark}): build the drafter from the backbone's config")
        device = next(drafter.parameters()).device
        if device != model.embed.weight.device:
            raise ValueError(f"the drafter is on {device}, the engine's model on {model.embed.weight.device}: put "
                             "them on the same device")
        d = dcfg.dspark
        K = d.block_size if spec_tokens is None else spec_tokens
        if not isinstance(K, int) or not 1 <= K <= d.block_size:
            raise ValueError(f"spec_tokens={spec_tokens!r} must be in 1..model.dspark.block_size={d.block_size} (the "
                             "drafts of one block)")
        if K >= d.window:
            raise ValueError(f"spec_tokens={K} must be below model.dspark.window={d.window} (a step's kept positions "
                             "go into the drafter's window)")
        if schedule not in SCHEDULES:
            raise ValueError(f"spec_schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        self.model, self.drafter, self.spec_tokens, self.schedule = model, drafter, K, schedule
        self.targets = list(d.target_layers)
        self.scheduler = SpecScheduler(K, schedule)
        self.curve = ThroughputCurve(K)

    @property
    def cache_tokens(self) -> int:
        """The cache's speculation headroom: a stopped row takes back its whole verify forward, K + 1 tokens."""
        return self.spec_tokens + 1

    def capture(self):
        """Around a batch's backbone forwards: the stream means of the target layers, {layer: [B, T, dim]} of the last
        forward."""
        return stream_means(self.model, self.targets)

    def new_ring(self, batch: int) -> ContextRing:
        w = self.model.embed.weight
        return ContextRing(batch, self.drafter.cfg.dspark.window, self.model.cfg.dim, w.dtype, w.device)

    def _context(self, means: dict, rows: int) -> torch.Tensor:
        """main_x [B, rows, dim] of the last `rows` rows the last forward computed in every target layer."""
        return self.drafter.context({i: means[i][:, means[i].shape[1] - rows:] for i in self.targets})

    def record_prefill(self, ring: ContextRing, first_row: int, row_cache, means: dict) -> None:
        """After a prefill call on cache rows first_row.. (row_cache, their view): its last computed rows (a trimmed
        prefill's decoder ran on the prompt's last rows only) of the last W positions into the ring."""
        rows = min(min(means[i].shape[1] for i in self.targets), ring.window)
        g = row_cache.batch_size
        positions = row_cache.lengths[:, None] - rows + torch.arange(rows, device=row_cache.lengths.device)
        ring.write(torch.arange(first_row, first_row + g, device=positions.device), positions,
                   self._context(means, rows), torch.ones_like(positions, dtype=torch.bool))

    # -- the decode loop -------------------------------------------------------------------------------------------
    def decode(self, cache, ring: ContextRing, means: dict, last: list[int], params, gens, comps, active: list[bool],
               emit, call, stats: dict) -> None:
        """Decode every active row to its end. last [B] the tokens emitted last (not yet in the cache); comps the
        rows' Completions so far; emit(b, token, logprob, model_logprob) -> whether row b goes on; call(ids [B, T])
        -> logits [B, T, V] appended to the cache (inside `capture`, whose dict is `means`); stats the engine's."""
        B, dev, sched = cache.batch_size, cache.lengths.device, self.scheduler
        if self.schedule == "auto" and not self.curve.measured(B):
            self.calibrate(B)
        while any(active):
            anchors = cache.lengths.clone()  # [B]: the anchors' positions (everything before them is in the cache)
            tokens = torch.tensor(last, device=dev)  # [B]
            k, drafts, q, survival = 0, tokens[:, None][:, :0], None, None
            if sched.wants_drafts():
                t0 = _now(dev)
                drafts, q, survival = self._draft(ring, anchors, tokens, params, gens, active)
                seconds = _now(dev) - t0
                self.curve.observe_draft(B, seconds)
                stats["draft_s"] += seconds
                left = torch.tensor([p.max_new_tokens - len(c.token_ids) if a else 0
                                     for p, c, a in zip(params, comps, active)])
                k = sched.choose(survival.cpu(), left, self.curve.verify_s(B), self.curve.draft_s(B))
            drafts = drafts[:, :k]
            t0 = _now(dev)
            logits = call(torch.cat((tokens[:, None], drafts), dim=1))  # [B, k + 1, V]
            self.curve.observe_verify(B, k, _now(dev) - t0)
            n, nxt, sampling_lp = self._accept(logits, drafts, q, params, gens, active)
            if k > 0:
                sched.observe(survival[:, :k].cpu(), torch.tensor(n), torch.tensor(active))
            model_lp = logits.float().log_softmax(-1)
            stats["decode_forwards"] += 1
            new_len = anchors.clone()
            for b in range(B):
                if not active[b]:
                    continue  # stopped: back to its length
                stats["decode_row_forwards"] += 1
                stats["drafted_tokens"] += k
                stats["accepted_tokens"] += n[b]
                for j, t in enumerate(drafts[b, :n[b]].tolist() + [nxt[b]]):
                    lp = 0.0 if sampling_lp[b] is None else float(sampling_lp[b][j, t])
                    stats["decode_tokens"] += 1
                    if not emit(b, t, lp, float(model_lp[b, j, t])):
                        active[b] = False
                        break
                if active[b]:
                    new_len[b] += 1 + n[b]
                    last[b] = nxt[b]
            goes_on = torch.tensor(active, device=dev)
            if goes_on.any():  # the kept positions a..a+n of the rows that go on into the drafter's context
                j = torch.arange(k + 1, device=dev)
                kept = (j[None] <= torch.tensor(n, device=dev)[:, None]) & goes_on[:, None]
                ring.write(torch.arange(B, device=dev), anchors[:, None] + j, self._context(means, k + 1), kept)
            cache.rollback(new_len)

    def _draft(self, ring: ContextRing, anchors, tokens, params, gens, active):
        """The K drafts of every row: (drafts [B, K], q: per row its K sampling distributions [V] (sampled active
        rows) or None, survival [B, K] = sigmoid(confidence))."""
        ctx, visible = ring.window_at(anchors)
        h = self.drafter.draft_hidden(self.model.embed, ctx, visible, anchors, tokens)  # [B, Kb, dim]
        q = [[] if a and p.temperature > 0 else None for p, a in zip(params, active)]
        prev, drafts, survival = tokens, [], []
        for j in range(self.spec_tokens):
            logits, confidence = self.drafter.heads(self.model.head, h[:, j], prev)  # [B, V], [B]
            d = logits.argmax(dim=-1)  # greedy requests (and stopped rows, whose drafts nobody reads)
            for b, qb in enumerate(q):
                if qb is not None:
                    probs = sampling_logprobs(logits[b], params[b]).exp()  # q_j: the request's transform
                    qb.append(probs)
                    d[b] = int(torch.multinomial(probs.cpu(), 1, generator=gens[b]))
            drafts.append(d)
            survival.append(torch.sigmoid(confidence))
            prev = d
        return torch.stack(drafts, dim=1), q, torch.stack(survival, dim=1)

    def _accept(self, logits, drafts, q, params, gens, active):
        """logits [B, k + 1, V] of the verify forward, drafts [B, k] -> (accepted n [B], next token [B], per row the
        sampling log-probs [k + 1, V] of p_t (sampled active rows) or None)."""
        B, k = drafts.shape
        n, nxt = (t.tolist() for t in accept_greedy(logits, drafts))
        sampling_lp = [None] * B
        for b, p in enumerate(params):
            if not active[b] or p.temperature == 0:
                continue
            lp = torch.stack([sampling_logprobs(logits[b, j].float(), p) for j in range(k + 1)])  # [k + 1, V]
            sampling_lp[b] = lp
            qb = torch.stack(q[b][:k]) if k else lp.new_zeros(0, lp.shape[-1])
            nb, tb = accept_sampled(lp.exp()[None].cpu(), qb[None].cpu(), drafts[b:b + 1].cpu(), gens[b])
            n[b], nxt[b] = int(nb), int(tb)
        return n, nxt, sampling_lp

    @torch.no_grad()
    def calibrate(self, batch: int, repeats: int = 3) -> None:
        """t(k) at this batch size, k = 0..K: verify forwards of k + 1 tokens a row on a scratch cache after a short
        prefill, each rolled back; the first round warms up (lazy allocations, kernels), the others are measured."""
        K, dev = self.spec_tokens, self.model.embed.weight.device
        cache = self.model.new_cache(batch, 2 + K + 1, replay="none", spec_tokens=K + 1)
        ids = torch.full((batch, K + 1), self.drafter.cfg.dspark.noise_token, dtype=torch.long, device=dev)
        self.model(ids[:, :2], cache=cache)
        for r in range(repeats):
            for k in range(K + 1):
                t0 = _now(dev)
                self.model(ids[:, :k + 1], cache=cache)
                if r > 0:
                    self.curve.observe_verify(batch, k, _now(dev) - t0)
                cache.rollback(cache.lengths - (k + 1))
