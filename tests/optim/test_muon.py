"""The report's optimisers (optim/muon.py, optim/sinkhorn.py, optim/hybrid.py, optim/rules.py) in one process:
Newton-Schulz, head-wise and stacked Muon, the Sinkhorn balance and its untouched rows, the grouping rules."""

from __future__ import annotations

import pytest
import torch

import model as model_pkg
from model.attention import head_rows
from optim.builder import build_optimizer
from optim.muon import RMS, newton_schulz, orthogonalise
from optim.rules import ParamRule, assign
from optim.sinkhorn import balance
from tests.helpers import load_config, load_optim_config


def _conditioned(m: int, n: int, cond: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k)
    return 3.0 * u @ torch.diag(s) @ v.T


@pytest.mark.parametrize("shape", [(32, 32), (16, 64), (96, 24)])
@pytest.mark.parametrize("cond", [1.0, 1e2, 1e3])
def test_newton_schulz_gives_singular_values_near_one(shape, cond):
    """The hybrid schedule (8 quintic steps, 2 of (2, -1.5, 0.5)) takes random matrices of several shapes and
    condition numbers to singular values within 1% of 1 (fp32 on the CPU), and keeps the singular vectors."""
    g = _conditioned(*shape, cond, seed=int(cond) + shape[0])
    o = newton_schulz(g)
    sv = torch.linalg.svdvals(o)
    assert sv.min() > 0.99 and sv.max() < 1.01, (sv.min(), sv.max())
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(o, u @ vh, rtol=0, atol=2e-3)


def test_headwise_muon_is_muon_per_head_block_and_stacked_experts_are_per_expert():
    w = torch.randn(4 * 8, 20)
    (got,) = orthogonalise([w], [8])
    want = torch.cat([orthogonalise([w[h * 8:(h + 1) * 8]], [None])[0] for h in range(4)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(got, orthogonalise([w], [None])[0], atol=1e-2)  # not the whole-matrix update
    experts = torch.randn(5, 12, 16)
    (got,) = orthogonalise([experts], [None])
    want = torch.stack([orthogonalise([e], [None])[0] for e in experts])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # each block's update has the RMS AdamW's typically has, whatever its shape
    for block in (*got, *orthogonalise([w], [8])[0].split(8)):
        assert abs(block.square().mean().sqrt().item() - RMS) < 1e-3


def test_blocks_of_one_shape_are_batched_across_parameters():
    """Stacking blocks of several parameters into one iteration gives each parameter what it gets alone."""
    a, b, c = torch.randn(16, 24), torch.randn(3, 16, 24), torch.randn(40, 8)
    together = orthogonalise([a, b, c], [None, None, None])
    alone = [orthogonalise([t], [None])[0] for t in (a, b, c)]
    for x, y in zip(together, alone):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_muon_step_is_the_documented_update():
    """Two steps by hand: Nesterov momentum, its orthogonal factor scaled to RMS 0.2 * sqrt(max(m, n)) /
    sqrt(max(m, n)), decoupled weight decay."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(12, 20))
    group = dict(params=[p], kind="muon", lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, rms=RMS,
                 head_rows=None)
    from optim.hybrid import Hybrid

    opt = Hybrid([group])
    ref, buf = p.detach().clone(), torch.zeros(12, 20)
    for step in range(2):
        grad = torch.randn(12, 20, generator=torch.Generator().manual_seed(step))
        p.grad = grad.clone()
        opt.step()
        buf = 0.9 * buf + grad
        o = newton_schulz(grad + 0.9 * buf) * (RMS * 20 ** 0.5)
        ref = ref * (1 - 0.05 * 0.1) - 0.05 * o
        torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(8, 32), (100, 16), (1, 32), (40, 40), (3, 5)])
def test_sinkhorn_balance_equalises_row_and_column_rms(shape):
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * torch.rand(shape[0], 1) * 10
    b = balance(u, iters=8, rms=0.2)
    rows, cols = b.square().mean(1).sqrt(), b.square().mean(0).sqrt()
    assert (rows - 0.2).abs().max() < 1e-3 and (cols - 0.2).abs().max() < 1e-3, (rows, cols)
    assert torch.equal(torch.sign(b), torch.sign(u))  # a positive rescaling of each entry


def test_sinkhorn_momentum_leaves_untouched_rows_and_their_state_bit_identical():
    """A table whose gradient reaches some rows: those rows and their momentum move, every other row and its
    momentum stays bit for bit (weight decay included); the next step's rows likewise."""
    from optim.hybrid import Hybrid

    table = torch.nn.Parameter(torch.randn(50, 16))
    opt = Hybrid([dict(params=[table], kind="sinkhorn", lr=0.1, weight_decay=0.1, momentum=0.9, nesterov=True,
                       rms=0.2, iters=8)])
    for step, rows in enumerate(([3, 7, 7, 20], [7, 41])):
        before = table.detach().clone()
        state_before = opt.state[table]["momentum_buffer"].clone() if step else torch.zeros(50, 16)
        emb = torch.nn.functional.embedding(torch.tensor(rows), table)
        table.grad = None
        (emb * torch.randn(emb.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        hit = torch.zeros(50, dtype=torch.bool)
        hit[rows] = True
        after, state = table.detach(), opt.state[table]["momentum_buffer"]
        assert torch.equal(after[~hit], before[~hit]) and torch.equal(state[~hit], state_before[~hit])
        assert (after[hit] != before[hit]).all(dim=1).all() and (state[hit] != state_before[hit]).any(dim=1).all()
        # the touched rows' update is balanced: row RMS 0.2 (lr 0.1), after the decay
        upd = (before[hit] * (1 - 0.1 * 0.1) - after[hit]) / 0.1
        torch.testing.assert_close(upd.square().mean(1).sqrt(), torch.full((hit.sum(),), 0.2), rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", ["v41_tiny", "v41_small", "v41_flash"])
def test_the_rules_cover_every_parameter_exactly_once(name):
    """conf/optim/muon.yaml's rules give each parameter of every config one optimiser: the matrices Muon (the Q/K
    projections head-wise), the embedding, head and Engram tables Sinkhorn, the rest AdamW."""
    cfg = load_optim_config("muon")
    mc = load_config(name)
    with torch.device("meta"):
        m = model_pkg.build(mc)
    named = list(m.named_parameters())
    kinds = {n: cfg.rules[i].optimizer for (n, _), i in zip(named, assign([n for n, _ in named], cfg.rules))}
    assert all(kinds[n] == "muon" for n, p in named if p.ndim == 3)  # stacked experts
    assert all(kinds[n] == "adamw" for n, p in named if p.ndim == 1)
    assert kinds["embed.weight"] == kinds["head.weight"] == "sinkhorn"
    assert all(kinds[n] == "sinkhorn" for n in kinds if n.endswith("engram.table"))
    assert kinds["layers.0.attn.wq_b.weight"] == kinds["layers.0.attn.wo_a.weight"] == "muon"
    rows = head_rows(mc)
    assert rows["attn.wq_b.weight"] == mc.attention.head_dim


def test_a_parameter_matched_by_no_rule_or_by_two_is_named():
    rules = [ParamRule(params=["*.weight"], optimizer="muon"), ParamRule(params=["embed.*"], optimizer="sinkhorn")]
    with pytest.raises(ValueError, match=r"matched by no rule: layers.0.bias.*more than one rule: embed.weight"):
        assign(["layers.0.w.weight", "layers.0.bias", "embed.weight"], rules)
    with pytest.raises(ValueError, match="headwise applies to optimizer=muon only"):
        ParamRule(params=["x"], optimizer="adamw", headwise=True)


def test_the_builder_groups_the_tiny_model_and_logs_the_table():
    mc = load_config("v41_tiny")
    with torch.device("meta"):
        m = model_pkg.build(mc)
    m.to_empty(device="cpu")
    lines = []
    opt = build_optimizer(m.parameters(), load_optim_config("muon"), named=m.named_parameters(), head_rows=head_rows(mc),
                          log=lines.append)
    kinds = {g["kind"] for g in opt.param_groups}
    assert kinds == {"adamw", "muon", "sinkhorn"}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))
    assert {g["head_rows"] for g in opt.param_groups if g["kind"] == "muon"} == {None, 64, 32}
    table = lines[0]
    assert "Q/K projections" in table and "heads of 64 rows" in table and "Engram tables" in table


def test_muon_in_chunks_equals_muon_in_one_batch(monkeypatch):
    """The step orthogonalises blocks of one shape in chunks of at most optim.hybrid.CHUNK values (its transient
    memory bounded by a chunk): the same parameters after two steps as one batch of all of them."""
    import optim.hybrid as hybrid

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(3, 8, 12)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(8, 12))]
        opt = hybrid.Hybrid([dict(params=ps, kind="muon", lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True,
                                  rms=RMS, head_rows=None)])
        for step in range(2):
            for i, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            opt.step()
        return [p.detach().clone() for p in ps]

    whole = run()
    monkeypatch.setattr(hybrid, "CHUNK", 300)  # one [3, 8, 12] parameter (288 values) a chunk
    for a, b in zip(run(), whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
