"""Proves the Triton Engram kernels (kernels/engram_triton.py) compute model.engram.Engram, forward and backward:

- the gather copies table rows bit for bit (fp32 and bf16 tables) for [N, C] row ids, repeated ids included; an
  FP8 table (float8_e4m3fn + e8m0 or fp32 scales per 32 channels) is dequantised on load exactly as
  kernels.fp8.dequantize_fp8 does; ids outside the table give NaN rows instead of reading out of bounds;
- the table gradient equals F.embedding's (rows read several times accumulate; untouched rows stay 0), both as a
  dense gradient (atomics) and as a sparse one holding only the touched rows;
- the fused gate + update, composed with the gather and wkv as model.kernels.engram_forward does, equals
  Engram.forward (fp32 to ~1e-6, bf16 to a bf16 rounding), dead tokens get a 0 gate and keep their streams
  unchanged, and the gate equals the reference formula;
- gradients w.r.t. S, the table, wkv and q/k weights match the reference's autograd, with awkward sizes
  (N = 14 tokens, D = 40, C = 6 sub-tables, Dh = 96) and n = 4 or 3 streams;

The rest of what it proves: docs/testing.md#triton-engram-kernels
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the kernels

from kernels import engram_triton as et  # noqa: E402
from kernels.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from model import kernels as kern  # noqa: E402
from model.config import CSA2Config, EngramConfig, MHCConfig, ModelConfig  # noqa: E402
from model.engram import Engram  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like returns NaN-filled floats (and junk integers), so unwritten elements show."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-77)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def _engram(n: int, dtype: torch.dtype) -> Engram:
    """A tiny Engram (C = 2 orders x 3 heads = 6 sub-tables, Dh = 96, D = 40) with O(1) weights."""
    ecfg = EngramConfig(layers=[1], max_ngram=3, num_heads=3, head_dim=96, prime_start=50,
                        compressed_vocab_size=300, pad_id=2)
    cfg = ModelConfig(vocab_size=300, dim=40, num_layers=2, num_encoder_layers=1, norm_eps=1e-6,
                      csa2=CSA2Config(compress_ratios=[0, 0]), mhc=MHCConfig(num_streams=n), engram=ecfg,
                      kernels="reference")  # its forward is the reference, on a GPU too
    m = Engram(cfg, 1)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        m.table.copy_(torch.randn(m.table.shape, generator=g))
        m.wkv.weight.copy_(torch.randn(m.wkv.weight.shape, generator=g) * 0.05)
        m.q_weight.copy_(torch.rand(m.q_weight.shape, generator=g) + 0.5)
        m.k_weight.copy_(torch.rand(m.k_weight.shape, generator=g) + 0.5)
    return m.to(device=DEVICE, dtype=dtype)


def _ids(m: Engram, B: int, T: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, m.num_rows, (B, T, m.num_columns), generator=torch.Generator().manual_seed(seed))
    ids[0, 0, :3] = 7  # one row read three times by one token, and by another token below
    ids[-1, -1, 0] = 7
    return ids.to(DEVICE)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values (unwritten?)"
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_is_a_bit_copy(poisoned, dtype):
    table = torch.randn(53, 96).to(dtype).to(DEVICE)
    ids = torch.randint(0, 53, (14, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    rows = et.gather_rows(table, ids)
    assert rows.dtype == dtype and rows.shape == (14, 6, 96)
    assert torch.equal(rows.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       F.embedding(ids, table).view(rows.view(torch.int16 if dtype == torch.bfloat16 else
                                                              torch.int32).dtype))


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gather_dequantises_an_fp8_table(poisoned, scale_dtype, out_dtype):
    dense = torch.randn(53, 96) * torch.logspace(-3, 3, 53)[:, None]
    values, scales = quantize_fp8(dense.to(DEVICE))  # the checkpoint format: e4m3 + one scale per 32
    ref_table = dequantize_fp8(values, scales)  # [53, 96] fp32
    scales = scales.to(scale_dtype) if scale_dtype == torch.float32 else scales
    ids = torch.randint(0, 53, (14, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = et.gather_rows(values, ids, scales, out_dtype=out_dtype)
    assert torch.equal(rows, F.embedding(ids, ref_table).to(out_dtype))
    assert torch.equal(et.lookup(values, ids, scales, out_dtype=out_dtype), rows)


def test_gather_out_of_range_ids_give_nan_rows(poisoned):
    table = torch.randn(10, 32, device=DEVICE)
    ids = torch.tensor([[0, 10], [-1, 9]], device=DEVICE)
    rows = et.gather_rows(table, ids)
    assert torch.isnan(rows[0, 1]).all() and torch.isnan(rows[1, 0]).all()
    assert torch.equal(rows[0, 0], table[0]) and torch.equal(rows[1, 1], table[9])


@pytest.mark.parametrize("table_grad", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_gradient_lands_on_touched_rows_only(poisoned, table_grad, dtype):
    table = torch.randn(53, 96).to(dtype).to(DEVICE).requires_grad_()
    ids = torch.randint(0, 53, (14, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ids[0, :3] = 5
    g = torch.randn(14, 6, 96, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    (grad,) = torch.autograd.grad((et.lookup(table, ids, table_grad=table_grad) * g).sum(), table)
    (ref,) = torch.autograd.grad((F.embedding(ids, table) * g).sum(), table)
    if table_grad == "sparse":
        assert grad.is_sparse and grad._nnz() == ids.numel()  # one entry per read row, nothing else
        grad = grad.to_dense()
    assert grad.dtype == dtype
    # bf16: the reference accumulates repeated rows in bf16, we in fp32 and round once.
    assert _rel_err(grad, ref) <= (1e-6 if dtype == torch.float32 else 2.0**-6)
    untouched = torch.ones(53, dtype=torch.bool, device=DEVICE)
    untouched[ids.flatten()] = False
    assert (grad[untouched] == 0).all()


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_engram(poisoned, n, dtype):
    m = _engram(n, dtype)
    B, T, D = 2, 7, m.dim
    ids = _ids(m, B, T, seed=n)
    dead = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    dead[1, 2] = dead[0, 6] = True
    results = {}
    for impl in ("reference", "triton"):
        S = torch.randn(B, T, n, D, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
        S.requires_grad_()
        m.zero_grad()
        # the triton side: the kernels as model.kernels composes them into Engram.forward
        out = m(S, ids, dead) if impl == "reference" else kern.engram_forward(m, S, ids, dead)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
        (out.float() * weight).sum().backward()
        results[impl] = {"out": out.detach(), "S": S.grad, "table": m.table.grad, "wkv": m.wkv.weight.grad,
                         "q": m.q_weight.grad, "k": m.k_weight.grad}
        if impl == "triton":
            assert torch.equal(out[dead], S[dead]), "dead tokens must keep their streams"
    ref, got = results["reference"], results["triton"]
    for name in ref:
        assert got[name].dtype == ref[name].dtype, name
        rel = 1e-5 if dtype == torch.float32 else 2.0**-7
        assert _rel_err(got[name], ref[name]) <= rel, (name, _rel_err(got[name], ref[name]))


def test_gate_equals_reference_formula(poisoned):
    m = _engram(4, torch.float32)
    N, n, D = 14, 4, m.dim
    g = torch.Generator().manual_seed(4)
    S = torch.randn(N, n, D, generator=g).to(DEVICE)
    kv = torch.randn(N, (n + 1) * D, generator=g).to(DEVICE)
    kv[3, :n * D] = S[3].flatten() * -2.0  # a strongly negative score
    kv[4, :D] = 0.0  # a zero key: score exactly 0 -> gate 0.5
    dead = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    dead[5] = True
    qk = (m.q_weight * m.k_weight).detach()
    s_out, gate, sums = et.gate_fwd(S, kv, qk, dead, m.eps, block_r=8, block_d=16, num_warps=4)
    ref_gate = m.gate(S[None], kv[:, : n * D].view(1, N, n, D), dead[None])[0]
    torch.testing.assert_close(gate, ref_gate, rtol=1e-5, atol=1e-6)
    assert gate[5].eq(0).all() and gate[4, 0] == 0.5 and (gate[3] < 0.5).all()
    torch.testing.assert_close(s_out, S + ref_gate[..., None] * kv[:, None, n * D:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums[..., 1], S.square().sum(-1))


def test_bad_inputs_raise():
    S = torch.randn(3, 4, 8, device=DEVICE)
    kv = torch.randn(3, 40, device=DEVICE)
    qk = torch.ones(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="kv must be"):
        et.gate_update(S, kv[:, :32], qk, None, 1e-6)
    with pytest.raises(ValueError, match="qk must be"):
        et.gate_update(S, kv, qk[:3], None, 1e-6)
    with pytest.raises(ValueError, match="dead must be"):
        et.gate_update(S, kv, qk, torch.zeros(3, dtype=torch.int64, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="row_ids"):
        et.gather_rows(torch.randn(5, 32, device=DEVICE), torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="scales"):
        et.gather_rows(torch.zeros(5, 32, device=DEVICE).to(torch.float8_e4m3fn), torch.zeros(2, dtype=torch.long,
                                                                                                 device=DEVICE))
    with pytest.raises(ValueError, match="table_grad"):
        et.lookup(torch.randn(5, 32, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                  table_grad="coo")
