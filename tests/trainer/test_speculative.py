"""Verification of drafted blocks (trainer/engine/speculative.py): greedy speculation emits exactly the backbone's
greedy tokens, and speculative sampling emits sequences distributed exactly as the backbone's own samples, measured
on a small vocabulary with many rows (a chi-square test that a draft-biased rule fails)."""

from __future__ import annotations

import torch

from trainer.engine.speculative import accept_greedy, accept_sampled

V, K, L = 4, 3, 3  # vocabulary, drafts per block, tokens compared per row
ROWS = 60_000
CHI2_CRIT = 113.0  # chi-square with V**L - 1 = 63 degrees of freedom at p = 1e-4


def _chains(seed: int):
    """A 'backbone' and a 'drafter' as first-order Markov chains over V tokens: row x is the distribution of the
    token after x."""
    g = torch.Generator().manual_seed(seed)
    target = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    draft = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    return target, draft, g


def _speculate(target, draft, g, rule):
    """Rounds of draft K, verify, emit, for ROWS rows starting after token 0, until every row has L tokens; returns
    [ROWS, L]. rule(p_t [B, K+1, V], q [B, K, V], drafts [B, K]) -> (accepted, next)."""
    out = torch.full((ROWS, L + K + 1), -1)
    count = torch.zeros(ROWS, dtype=torch.int64)
    last = torch.zeros(ROWS, dtype=torch.int64)
    rows = torch.arange(ROWS)
    while (count < L).any():
        drafts, q, prev = [], [], last
        for _ in range(K):
            qk = draft[prev]
            d = torch.multinomial(qk, 1, generator=g).squeeze(1)
            drafts.append(d)
            q.append(qk)
            prev = d
        drafts, q = torch.stack(drafts, 1), torch.stack(q, 1)
        p_t = target[torch.cat((last[:, None], drafts), 1)]  # [B, K + 1, V]: after the last token and each draft
        n, nxt = rule(p_t, q, drafts)
        emitted = torch.cat((drafts, torch.zeros_like(nxt)[:, None]), 1)
        emitted[rows, n] = nxt
        live = count < L
        for j in range(K + 1):
            take = live & (j <= n)
            out[rows[take], count[take] + j] = emitted[take, j]
        count = torch.where(live, count + n + 1, count)
        last = torch.where(live, nxt, last)
    return out[:, :L]


def _chi2(seqs, target) -> float:
    codes = (seqs * torch.tensor([V ** (L - 1 - i) for i in range(L)])).sum(1)
    observed = torch.bincount(codes, minlength=V ** L).double()
    probs = torch.ones(V ** L, dtype=torch.float64)
    for c in range(V ** L):
        prev = 0
        for i in range(L):
            tok = c // V ** (L - 1 - i) % V
            probs[c] *= float(target[prev, tok])
            prev = tok
    expected = probs * ROWS
    return float(((observed - expected) ** 2 / expected).sum())


def test_speculative_sampling_emits_the_backbones_distribution():
    target, draft, g = _chains(0)
    seqs = _speculate(target, draft, g, lambda p, q, d: accept_sampled(p, q, d, generator=g))
    assert _chi2(seqs, target) < CHI2_CRIT
    # the test's power: accepting every draft emits the drafter's chain, and the statistic sees it
    biased = _speculate(target, draft, g, lambda p, q, d: (torch.full((d.shape[0],), K),
                                                           torch.multinomial(p[:, -1], 1, generator=g).squeeze(1)))
    assert _chi2(biased, target) > 10 * CHI2_CRIT


def test_identical_distributions_accept_every_draft():
    target, _, g = _chains(1)
    drafts = torch.multinomial(target[torch.zeros(500, dtype=torch.int64)], 1, generator=g).repeat(1, K)
    q = target[drafts]
    p_t = torch.cat((q, target[drafts[:, -1:]]), 1)
    n, _ = accept_sampled(p_t, q, drafts, generator=g)
    assert (n == K).all()


def test_greedy_speculation_emits_the_backbones_greedy_tokens():
    target, draft, g = _chains(2)
    seqs = _speculate(target, draft, g, lambda p, q, d: accept_greedy(p.log(), d))
    want, prev = [], 0
    for _ in range(L):
        prev = int(target[prev].argmax())
        want.append(prev)
    assert (seqs == torch.tensor(want)).all()
    # a partial acceptance: the first draft right, the second wrong
    logits = torch.log(target[torch.tensor([[0, 1, 2, 3]])])
    best = logits.argmax(-1)[0]
    drafts = torch.tensor([[int(best[0]), (int(best[1]) + 1) % V, 0]])
    n, nxt = accept_greedy(logits, drafts)
    assert int(n) == 1 and int(nxt) == int(best[1])
