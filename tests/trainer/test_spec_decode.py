"""Speculative decoding in the engine (trainer/engine/spec_decode.py; DSpark's inference methods in model/dspark.py;
the scheduler in trainer/engine/speculative.py).

- Greedy: the speculative engine returns the plain engine's tokens (prompts of different lengths batched, a stop
  token, max_new_tokens, replay "halo" and "none", fixed and auto schedules), with a random drafter (every draft
  rejected) and with an oracle drafter that drafts the plain engine's tokens except at some slots (drafts accepted
  and rejected); the oracle's runs take fewer backbone forwards (stats: tokens per forward > 1).
- Sampling: on a 16-token backbone, the first 3 tokens of 1,000 seeded rows are distributed as the backbone's own
  sampling distribution (temperature and top-k), enumerated with teacher-forced forwards: a chi-square test at
  p = 1e-4, with drafts accepted (36.8 on 33 degrees of freedom against a threshold of 72; a rule biased toward the
  drafts, p_t(d) + 0.3 in the acceptance test, scores 3,566).

The rest of what it proves: docs/testing.md#speculative-decoding
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import model as model_pkg
from model.dspark import DSpark, stream_means
from tests.helpers import build_tiny, every_role_config, load_config
from trainer.engine import Engine, PrefixCache, Request, SamplingParams
from trainer.engine.sampling import sampling_logprobs as _sampling_logprobs
from trainer.engine.speculative import SpecScheduler, ThroughputCurve

K = 3  # spec_tokens (v41_tiny's block_size is 5)
EXACT_STORE = dict(cache_main_kv="none", cache_index="none", cache_swa_kv="none")


class OracleDrafter(DSpark):
    """A DSpark whose draft at slot j after the anchor at position a of row b is script[b][a + j + 1] (the token the
    backbone emits there), turned into another token where (a + j) % 3 == 2: so some drafts are accepted and some
    rejected. Records every draft_hidden call's inputs (`calls`). Set `script` before it drafts."""

    def draft_hidden(self, embed, ctx, ctx_visible, anchors, anchor_tokens):
        self.calls.append((ctx.clone(), ctx_visible.clone(), anchors.clone()))
        self._anchors, self._slot = anchors.tolist(), 0
        return super().draft_hidden(embed, ctx, ctx_visible, anchors, anchor_tokens)

    def heads(self, head, h, prev_tokens):
        logits, confidence = super().heads(head, h, prev_tokens)
        for b, a in enumerate(self._anchors):
            p = a + self._slot + 1
            if p < len(self.script[b]):
                tok = self.script[b][p] if (a + self._slot) % 3 != 2 else (self.script[b][p] + 1) % logits.shape[-1]
                logits[b, tok] += 1e3
        self._slot += 1
        return logits, confidence


def _drafter(cfg, cls=DSpark, seed: int = 0):
    torch.manual_seed(seed)
    d = cls(cfg)
    d.init_weights()
    d.calls = []
    return d.eval()


@pytest.fixture(scope="module")
def tiny():
    """v41_tiny with the cache storing the forward's values: serving then computes the teacher-forced forward (the
    fp4 / fp8 formats would quantise what the forward does not)."""
    return build_tiny(seed=1, quant=dataclasses.replace(load_config("v41_tiny").quant, **EXACT_STORE)).eval()


def _requests(stop: int | None = None):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (9, 40, 23)]  # 40 > the window (32)
    return [Request(p, SamplingParams(temperature=0, max_new_tokens=m, stop_token_ids=[stop] if stop else []),
                    request_id=i) for i, (p, m) in enumerate(zip(prompts, (14, 6, 11)))]


@pytest.fixture(scope="module")
def plain(tiny):
    """The plain engine's greedy completions per replay, with a stop token that ends request 0 early."""
    out = {}
    for replay in ("halo", "none"):
        free = Engine(tiny, replay=replay).generate(_requests())
        stop = free[0].token_ids[8]
        eng = Engine(tiny, replay=replay)
        out[replay] = (stop, eng.generate(_requests(stop)), eng.stats)
    assert out["halo"][1][0].finish_reason == "stop" and len(out["halo"][1][0].token_ids) < 14
    return out


@pytest.mark.parametrize("replay,schedule,oracle", [("halo", "fixed", False), ("none", "auto", False),
                                                    ("halo", "auto", True), ("none", "fixed", True)])
def test_greedy_speculation_returns_the_plain_engines_tokens(tiny, plain, replay, schedule, oracle):
    stop, want, plain_stats = plain[replay]
    drafter = _drafter(tiny.cfg, OracleDrafter if oracle else DSpark)
    drafter.script = [c.prompt_ids + c.token_ids for c in want]
    eng = Engine(tiny, replay=replay, drafter=drafter, spec_tokens=K, spec_schedule=schedule)
    streamed = []
    got = eng.generate(_requests(stop), on_token=lambda rid, tok, lp: streamed.append((rid, tok)))
    for c, w in zip(got, want):
        assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason
        assert c.logprobs == [0.0] * len(c.token_ids)  # greedy: a point mass
        torch.testing.assert_close(torch.tensor(c.model_logprobs), torch.tensor(w.model_logprobs), rtol=0,
                                   atol=1e-4)
        assert [t for rid, t in streamed if rid == c.request_id] == c.token_ids
    s = eng.stats
    assert s["decode_tokens"] == plain_stats["decode_tokens"] == sum(len(c.token_ids) - 1 for c in got)
    if oracle:  # drafts accepted and rejected: fewer backbone forwards than tokens
        assert 0 < s["accepted_tokens"] < s["drafted_tokens"]
        assert s["tokens_per_forward"] > 1.2 and s["decode_forwards"] < plain_stats["decode_forwards"]
    else:
        assert s["accepted_tokens"] == 0 and s["tokens_per_forward"] == 1.0
    if schedule == "fixed":
        assert s["drafted_tokens"] == K * s["decode_row_forwards"]


def test_the_prefix_cache_with_speculation(tiny, plain):
    """The engine's caches all have the speculation headroom, so the prefix cache's SWA states fit them: a first run
    (misses), a second (block and SWA hits), a third with the SWA states expired (replay) all give the plain engine's
    tokens; the drafter does not see the positions before a hit (nothing computed them)."""
    stop, want, _ = plain["none"]
    drafter = _drafter(tiny.cfg, OracleDrafter)
    drafter.script = [c.prompt_ids + c.token_ids for c in want]
    pc = PrefixCache(tiny, block_size=16)
    eng = Engine(tiny, replay="none", prefix_cache=pc, drafter=drafter, spec_tokens=K)
    first = []
    for run in range(3):
        if run == 2:
            pc.expire_swa()
        first.append(len(drafter.calls))
        got = eng.generate(_requests(stop))
        assert [c.token_ids for c in got] == [c.token_ids for c in want], run
    assert pc.stats["swa_hits"] > 0 and pc.stats["replays"] > 0 and eng.stats["accepted_tokens"] > 0
    W = drafter.cfg.dspark.window
    for run, hit in ((0, 0), (1, 32), (2, 0)):  # row 1: 40 prompt tokens, 32 cached (the replay recomputes them)
        _, visible, anchors = drafter.calls[first[run]]
        assert visible[1].tolist() == (torch.arange(40 - W, 40) >= hit).tolist() and anchors[1] == 40


def test_the_drafters_context_is_the_teacher_forced_forwards(tiny, plain):
    """Every draft block read, at each visible position of its window, main_x of the teacher-forced forward of the
    final sequence (the prefill's last rows under halo replay, then the verify forwards' kept positions, across
    rollbacks); every position of the window is visible."""
    stop, want, _ = plain["halo"]
    drafter = _drafter(tiny.cfg, OracleDrafter)
    drafter.script = [c.prompt_ids + c.token_ids for c in want]
    Engine(tiny, replay="halo", drafter=drafter, spec_tokens=K).generate(_requests(stop))
    W = drafter.cfg.dspark.window
    with torch.no_grad():
        full = []
        for seq in drafter.script:
            with stream_means(tiny, drafter.cfg.dspark.target_layers) as means:
                tiny(torch.tensor([seq]))
            full.append(drafter.context(means)[0])  # [T, dim]
    for ctx, visible, anchors in drafter.calls:
        for b, a in enumerate(anchors.tolist()):
            if a >= len(drafter.script[b]):
                continue  # a row that has stopped
            pos = torch.arange(a - W, a)
            assert visible[b].tolist() == (pos >= 0).tolist()
            torch.testing.assert_close(ctx[b][visible[b]], full[b][pos[pos >= 0]], rtol=0, atol=1e-4)


def test_draft_hidden_and_heads_equal_the_training_forward(tiny):
    """The windowed inference methods on [a - W, a - 1] give the training forward's hidden states, logits and
    confidences on the whole context; what the window holds where it is not visible does not count."""
    drafter = _drafter(tiny.cfg)
    with torch.no_grad():
        drafter.markov_out.weight.normal_(0, 0.02)  # (zero at init: make the Markov term matter)
    cfg = tiny.cfg
    W, Kb = cfg.dspark.window, cfg.dspark.block_size
    g = torch.Generator().manual_seed(3)
    main_x = torch.randn(2, 48, cfg.dim, generator=g)
    anchors = torch.tensor([[41], [5]])  # a full window; one that starts before position 0
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=g)
    prev = torch.randint(0, cfg.vocab_size, (2, 1, Kb), generator=g)
    with torch.no_grad():
        out = drafter(tiny.embed, tiny.head, main_x, anchors, tokens.gather(1, anchors), prev)
        pos = anchors - W + torch.arange(W)  # [2, W]
        visible = pos >= 0
        ctx = main_x.gather(1, pos.clamp_min(0)[..., None].expand(-1, -1, cfg.dim))
        ctx = torch.where(visible[..., None], ctx, 7.0)  # junk where nothing exists
        h = drafter.draft_hidden(tiny.embed, ctx, visible, anchors[:, 0], tokens.gather(1, anchors)[:, 0])
        logits, confidence = drafter.heads(tiny.head, h, prev[:, 0])
    torch.testing.assert_close(h, out.hidden[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, out.logits[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(confidence, out.confidence[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="model.dspark.window=32"):
        drafter.draft_hidden(tiny.embed, ctx[:, 1:], visible[:, 1:], anchors[:, 0], tokens[:, 0])


# -- sampling ---------------------------------------------------------------------------------------------------------
V, L, ROWS = 16, 3, 1000
SAMPLING = SamplingParams(temperature=0.8, top_k=8, max_new_tokens=L)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at p = 1e-4 (z its normal quantile), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_speculative_sampling_is_distributed_as_the_backbone():
    """16-token vocabulary, the cache storing the forward's values (so serving computes the teacher-forced forward),
    the head scaled so that the distributions are far from uniform and the random drafter's from the backbone's."""
    cfg = every_role_config(vocab_size=V)
    cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, **EXACT_STORE),
                              dspark=dataclasses.replace(cfg.dspark, target_layers=[3, 4, 5], window=8, num_layers=1))
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    m.eval()
    with torch.no_grad():
        m.head.weight.mul_(10.0)
    prompt = [5, 9, 1, 12, 7]
    # (the random drafter of seed 2 has 18% of its drafts accepted: seed 0's 2%)
    eng = Engine(m, replay="none", max_batch=ROWS, drafter=_drafter(cfg, seed=2), spec_tokens=K)
    out = eng.generate([Request(prompt, dataclasses.replace(SAMPLING, seed=s)) for s in range(ROWS)])
    assert eng.stats["accepted_tokens"] > 0.1 * eng.stats["drafted_tokens"]
    # the backbone's distribution of the first L tokens: teacher-forced forwards over every prefix
    with torch.no_grad():
        seqs, probs = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64)
        for _ in range(L):
            rows = m(seqs)[:, -1]
            p = torch.stack([_sampling_logprobs(r, SAMPLING).exp() for r in rows]).double()  # [prefixes, V]
            probs = (probs[:, None] * p).flatten()
            seqs = torch.cat((seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]), 1)
    codes = torch.tensor([sum(t * V ** (L - 1 - i) for i, t in enumerate(c.token_ids)) for c in out])
    observed = torch.bincount(codes, minlength=V ** L).double()
    assert observed[probs == 0].sum() == 0  # nothing outside the top-k cut
    expected = probs * ROWS
    big = expected >= 5  # the rarer sequences pooled
    o = torch.cat((observed[big], observed[~big].sum()[None]))
    e = torch.cat((expected[big], expected[~big].sum()[None]))
    chi2 = float(((o - e) ** 2 / e).sum())
    assert len(o) > 20
    assert chi2 < _chi2_critical(len(o) - 1), (chi2, len(o) - 1)
    # each token's log-probs: the backbone's at its prefix, under the sampling distribution and its own
    for c in out[:3]:
        with torch.no_grad():
            logits = m(torch.tensor([prompt + c.token_ids]))[0, len(prompt) - 1:-1]
        sampling = [float(_sampling_logprobs(row, SAMPLING)[t]) for row, t in zip(logits, c.token_ids)]
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(sampling), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(c.model_logprobs),
                                   logits.log_softmax(-1)[torch.arange(L), c.token_ids], rtol=0, atol=1e-4)


# -- the scheduler ----------------------------------------------------------------------------------------------------
def test_fixed_schedule_verifies_every_draft():
    s = SpecScheduler(4, "fixed")
    assert s.wants_drafts() and s.choose(torch.zeros(2, 4), torch.tensor([9, 9]), [None] * 5, None) == 4


@pytest.mark.parametrize("survival,curve,draft_s,left,want", [
    (0.9, [1.0, 1.05, 1.1, 1.15], 0.1, 9, 3),  # flat cost, confident drafts: every draft (3.44 tokens / 1.25 s)
    (0.9, [1.0, 1.2, 1.9, 3.0], 0.0, 9, 1),  # a steep curve: 1.9 / 1.2 beats 2.71 / 1.9 and 1 / 1
    (0.9, [1.0, 2.0, 3.0, 4.0], 0.1, 9, 0),  # a verify token costs a forward: plain decoding
    (0.05, [1.0, 1.05, 1.1, 1.15], 0.1, 9, 0),  # drafts that will be rejected
    (1.0, [1.0, 1.05, 1.1, 1.15], 0.1, 1, 0),  # one token left: drafts cannot add any
    (1.0, [1.0, 1.05, 1.1, 1.15], 0.1, 2, 1),  # two left: one draft is enough
])
def test_auto_schedule_maximises_expected_tokens_per_second(survival, curve, draft_s, left, want):
    s = SpecScheduler(3, "auto")
    surv = torch.full((2, 3), survival)
    assert s.choose(surv, torch.tensor([left, 0]), curve, draft_s) == want  # row 1 has stopped: counts nothing
    e = s.expected_tokens(torch.tensor([[0.9, 0.5, 0.0]]), torch.tensor([9]))
    torch.testing.assert_close(e, torch.tensor([1.0, 1.9, 2.35, 2.35], dtype=torch.float64))


def test_auto_schedule_calibrates_the_confidences_by_what_verification_accepts():
    """An untrained confidence head (0.5 everywhere) whose drafts are all rejected: after a few verifies the expected
    tokens fall to about 1 a row and plain steps win; drafts accepted as predicted keep c near 1."""
    s = SpecScheduler(3, "auto")
    surv, left, curve, yes = torch.full((2, 3), 0.5), torch.tensor([9, 9]), [1.0, 1.02, 1.04, 1.06], torch.ones(2) > 0
    assert s.choose(surv, left, curve, 0.1) == 3  # 2 x 1.875 tokens / 1.16 s against 2 / 1 s
    for _ in range(10):
        s.observe(surv, torch.tensor([0, 0]), yes)
    assert s.calibration < 0.1 and s.choose(surv, left, curve, 0.1) == 0
    good = SpecScheduler(3, "auto")
    for _ in range(10):
        good.observe(surv, torch.tensor([1, 1]), yes)  # 0.875 predicted a row
    assert 1.0 < good.calibration < 1.2


def test_auto_schedule_backs_off_drafting_after_plain_steps():
    """After choosing k = 0, 1 then 2, 4 plain steps (no drafting) while it keeps choosing 0; a k > 0 resets it."""
    s = SpecScheduler(2, "auto", max_skip=4)
    bad, good = torch.full((1, 2), 0.01), torch.full((1, 2), 0.99)
    curve, left = [1.0, 1.0, 1.0], torch.tensor([50])
    pattern = []
    for step in range(12):
        if not s.wants_drafts():
            pattern.append("-")
            continue
        pattern.append(str(s.choose(good if step == 10 else bad, left, curve, 0.1)))
    assert "".join(pattern) == "0-0--0----20"


def test_throughput_curve_running_means():
    c = ThroughputCurve(2, rate=0.5)
    assert not c.measured(4) and c.verify_s(4) == [None] * 3 and c.draft_s(4) is None
    for k, t in ((0, 1.0), (1, 2.0), (2, 3.0), (1, 4.0)):
        c.observe_verify(4, k, t)
    c.observe_draft(4, 0.2)
    assert c.measured(4) and not c.measured(1) and c.verify_s(4) == [1.0, 3.0, 3.0] and c.draft_s(4) == 0.2
    with pytest.raises(ValueError, match="spec_schedule=auto needs"):
        SpecScheduler(2, "auto").choose(torch.ones(1, 2), torch.tensor([5]), c.verify_s(1), None)


def test_refusals(tiny):
    d = _drafter(tiny.cfg)
    with pytest.raises(ValueError, match="spec_tokens=6 must be in 1..model.dspark.block_size=5"):
        Engine(tiny, drafter=d, spec_tokens=6)
    with pytest.raises(ValueError, match="spec_schedule must be one of"):
        Engine(tiny, drafter=d, spec_schedule="greedy")
    with pytest.raises(ValueError, match="need a drafter"):
        Engine(tiny, spec_tokens=3)
    with pytest.raises(ValueError, match="cuda_graph=True"):
        Engine(tiny, drafter=d, cuda_graph=True)
    other = dataclasses.replace(tiny.cfg, dspark=dataclasses.replace(tiny.cfg.dspark, markov_rank=16))
    with pytest.raises(ValueError, match="the drafter's model.dspark"):
        Engine(tiny, drafter=_drafter(other))
    with pytest.raises(ValueError, match="model.dim=64"):
        Engine(tiny, drafter=_drafter(dataclasses.replace(tiny.cfg, dim=64)))
    eng = Engine(tiny, drafter=d)
    assert eng.spec.spec_tokens == tiny.cfg.dspark.block_size
    with pytest.raises(ValueError, match="return_routing=True is not supported with speculative decoding"):
        eng.generate([Request([1, 2, 3], return_routing=True)])
