"""trainer/loss.py: the step's LM loss is the mean over the valid tokens of the whole step, not a mean of
per-micro-batch means, takes per-token weights, and changes nothing where every micro-batch holds the same number
of valid tokens (pretraining).

- One process, three micro-batches with 0, 4 and 9 of 12 labels masked and per-token weights: compute_gradients'
  loss and every gradient equal those of one explicit objective, sum(weight x cross-entropy) over every valid token
  of the step / their number, plus the per-micro-batch aux terms averaged (1e-6 relative, the order of the sums).
  The mean of means is far from it (the test would notice the old rule).
- Equal counts: the share is exactly 1.0 and the LM term is bitwise F.cross_entropy's mean.
- A micro-batch with no valid label adds an exact zero and finite (zero) LM gradients.
(Every parallel layout against the single process with uneven masks and weights: tests/parallel/test_layouts.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import build_tiny
from trainer.loss import IGNORE_INDEX, LMLoss, StepTokens
from trainer.parallel.apply import ParallelModel
from trainer.train import compute_gradients

T = 12


def _batches(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for masked in (0, 4, 9):
        ids = torch.randint(0, vocab, (1, T + 1), generator=gen)
        labels = ids[:, 1:].clone()
        labels[:, :masked] = IGNORE_INDEX
        out.append({"input_ids": ids[:, :-1], "labels": labels,
                    "loss_weights": 0.5 + torch.rand(1, T, generator=gen)})
    return out


def _grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_step_loss_is_the_mean_over_the_steps_valid_tokens():
    torch.manual_seed(0)
    m = build_tiny(seed=0)
    batches = _batches(m.cfg.vocab_size)
    params = list(m.parameters())
    stats = compute_gradients(ParallelModel.local(m), batches, params, float("inf"))
    got = _grads(m)
    m.zero_grad(set_to_none=True)

    # the explicit objective, over the same forwards (the MoE counters do not enter the loss)
    total = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    lm_sum, aux_sum, means = 0.0, 0.0, []
    for b in batches:
        out = m(b["input_ids"], outputs=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
        lm_sum = lm_sum + (ce * b["loss_weights"].flatten()).sum()
        aux_sum = aux_sum + sum(out.aux.values()) / len(batches)
        means.append(float((ce * b["loss_weights"].flatten()).sum().detach() / (b["labels"] != IGNORE_INDEX).sum()))
    (lm_sum / total + aux_sum).backward()
    want = _grads(m)

    assert stats.loss == pytest.approx(float(lm_sum.detach()) / total, rel=1e-6)
    assert abs(sum(means) / len(means) - stats.loss) > 0.01  # the mean of means is another number
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


def test_equal_counts_change_nothing_bitwise():
    tokens = StepTokens(total=4 * 3 * 512, ranks=2, micro_batches=2)  # 2 ranks x 2 micro-batches x 3 rows x 512
    assert float(tokens.share(torch.tensor(3 * 512))) == 1.0
    logits = torch.randn(3, 7, 11)
    labels = torch.randint(0, 11, (3, 7))
    loss = LMLoss()
    loss.begin_step(StepTokens(total=3 * 7 * 6, ranks=3, micro_batches=2))
    assert torch.equal(loss.lm(logits, labels), F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_a_micro_batch_without_valid_labels_adds_an_exact_zero():
    logits = torch.randn(2, 5, 9, requires_grad=True)
    labels = torch.full((2, 5), IGNORE_INDEX)
    loss = LMLoss()
    loss.begin_step(StepTokens(total=10, ranks=1, micro_batches=2))
    for weights in (None, torch.rand(2, 5)):
        term = loss.lm(logits, labels, weights)
        assert float(term) == 0.0
        (grad,) = torch.autograd.grad(term, logits)
        assert torch.isfinite(grad).all() and float(grad.abs().sum()) == 0.0


def test_row_kinds_are_summed_per_kind_and_leave_the_loss_alone():
    """A batch's `row_kind` ([B]: 0 text, 1 multimodal) gives per-kind sums of the valid tokens' cross-entropies and
    their counts over the step's micro-batches (the metrics loss_text / loss_multimodal), equal to the explicit
    per-kind sums, with weights or without, fused or plain; the LM term is the one without row kinds."""
    from data.multimodal import ROW_KINDS

    assert LMLoss.num_kinds == len(ROW_KINDS)  # the sums' length: the trainer names them by ROW_KINDS
    gen = torch.Generator().manual_seed(5)
    B, V, D = 3, 11, 8
    kinds = torch.tensor([0, 1, 0])
    micro = []
    for k in range(2):
        hidden = torch.randn(B, T, D, generator=gen)
        labels = torch.randint(0, V, (B, T), generator=gen)
        labels[:, : 3 * k + 2] = IGNORE_INDEX
        micro.append((hidden, labels, 0.5 + torch.rand(B, T, generator=gen)))
    head = torch.nn.Linear(D, V, bias=False)
    for fused in (False, True):
        for weighted in (False, True):
            plain, with_kinds = LMLoss(fused=fused, chunk_size=5), LMLoss(fused=fused, chunk_size=5)
            sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
            for loss in (plain, with_kinds):
                loss.begin_step(StepTokens(sum(int((y != IGNORE_INDEX).sum()) for _, y, _ in micro), 1, 2))
            for hidden, labels, w in micro:
                w = w if weighted else None
                logits = None if fused else head(hidden)
                kw = dict(hidden=hidden, head=head) if fused else {}
                a = plain(logits, labels, w, **kw)
                b = with_kinds(logits, labels, w, batch={"row_kind": kinds}, **kw)
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
                ce = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="none",
                                     ignore_index=IGNORE_INDEX).view(B, T).double()
                valid = labels != IGNORE_INDEX
                for kind in (0, 1):
                    rows = kinds == kind
                    sums[kind] += ce[rows][valid[rows]].sum()
                    counts[kind] += valid[rows].sum()
            assert plain.kind_sums is None
            torch.testing.assert_close(with_kinds.kind_sums.loss, sums, rtol=1e-6, atol=1e-9)
            assert torch.equal(with_kinds.kind_sums.tokens, counts)
            with_kinds.begin_step(StepTokens(1))
            assert with_kinds.kind_sums is None  # a new step starts its own sums
