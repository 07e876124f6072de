"""Proves both Triton top-k kernels (`kernels.topk`, variant="resident" and variant="radix", run by the Triton CPU
interpreter) select what torch.topk selects:

- on random rows (no tie at the k-th value) the selected index SET equals torch.topk's and the values are the
  gathered inputs, at awkward sizes (N not a multiple of the chunk or of a power of two, k = 1, k = N, one entry),
  at every radix width the radix kernel takes (5, 8, 11 and 12 bits, so passes that do not divide 32 evenly) and at
  the resident kernel's largest row (N = RESIDENT_MAX_N, where its packed prefix counts are fullest);
- with ties at the k-th value it takes the lowest indices among the tied entries (the first k of a stable
  descending sort), also for all -inf rows, rows with fewer finite entries than k, negative values and a mix of
  -0.0 and +0.0 (equal, so tied);
- every output is written (NaN / sentinel-poisoned allocations) and empty cases (k = 0, no rows) work;
- variant="auto" takes the resident kernel when the row fits and torch.topk otherwise;

The rest of what it proves: docs/testing.md#triton-top-k-kernels
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported: the kernels then run on the CPU

import kernels.indexer as ix  # noqa: E402
import kernels.topk as tk  # noqa: E402
from model import csa2  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"
NEG_INF = float("-inf")
SMALL = dict(block_n=64)  # several chunks per row even at small N
# each variant's settings for the shared checks: the radix kernel with several chunks per row even at small N
VARIANTS = {"resident": dict(variant="resident"), "radix": dict(variant="radix", **SMALL)}
variants = pytest.mark.parametrize("cfg", list(VARIANTS.values()), ids=list(VARIANTS))


@pytest.fixture
def poison(monkeypatch):
    """torch.empty returns NaN-filled float and -7-filled integer tensors, so an output slot the kernel forgets shows
    up."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)


def tie_rule(x: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's contract: the first k of a stable descending sort (lowest indices first among equal values)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def check(x: torch.Tensor, k: int, **cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel; its sorted indices equal the tie rule's, and its values are x at those indices."""
    vals, idx = tk.topk(x, k, impl="triton", **cfg)
    assert vals.shape == idx.shape == (*x.shape[:-1], k)
    assert vals.dtype == torch.float32 and idx.dtype == torch.int32
    assert ((idx >= 0) & (idx < x.shape[-1])).all()
    want = tie_rule(x, k).sort(-1).values
    assert torch.equal(idx.long().sort(-1).values, want)
    # bitwise: the kernel copies the inputs (-0.0 stays -0.0)
    assert torch.equal(vals.view(torch.int32), x.gather(-1, idx.long()).view(torch.int32))
    return vals, idx


def assert_same_set_as_torch(x: torch.Tensor, k: int, idx: torch.Tensor) -> None:
    ref = x.topk(k, dim=-1, sorted=False).indices
    assert torch.equal(idx.long().sort(-1).values, ref.sort(-1).values)


@pytest.mark.parametrize("rows,n,k", [(3, 1, 1), (4, 37, 1), (5, 37, 37), (3, 200, 17), (2, 333, 100),
                                      (2, 129, 128)])
@variants
def test_random_rows_match_torch(poison, cfg, rows, n, k):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n + k)).to(DEVICE)
    _, idx = check(x, k, **cfg)
    assert_same_set_as_torch(x, k, idx)


@pytest.mark.parametrize("radix_bits", [5, 8, 11, 12])
def test_every_radix_width(poison, radix_bits):
    g = torch.Generator().manual_seed(radix_bits)
    x = torch.randn(3, 300, generator=g) * torch.logspace(-20, 20, 300)  # many exponents, both signs
    _, idx = check(x.to(DEVICE), 41, variant="radix", block_n=128, radix_bits=radix_bits)
    assert_same_set_as_torch(x.to(DEVICE), 41, idx)
    _, idx = check(x.to(DEVICE), 41, variant="resident")  # the same exponent spread through the bitwise search
    assert_same_set_as_torch(x.to(DEVICE), 41, idx)


@pytest.mark.parametrize("variant", ["auto", "radix"])
def test_default_config_and_leading_dims(poison, variant):
    """[B, T, N] input at the default settings (radix: TOPK_CONFIG, one chunk of 2048 covers N)."""
    x = torch.randn(2, 3, 1500, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _, idx = check(x, 64, variant=variant)
    assert_same_set_as_torch(x, 64, idx)


def test_resident_full_row(poison):
    """N = RESIDENT_MAX_N (no padding): the indexer's k = 512, k = N (all 2^15 keys above the threshold 0, the
    packed prefix count's largest high half) and all-tied rows (2^15 ties, its largest low half)."""
    n = tk.RESIDENT_MAX_N
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    for k in (512, n):
        _, idx = check(x, k, variant="resident")
        assert_same_set_as_torch(x, k, idx)
    x[1] = NEG_INF
    x[0] = torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(10)).float()
    for k in (1, n // 3, n - 1, n):
        check(x, k, variant="resident")


def test_auto_picks_resident_when_the_row_fits_and_torch_topk_otherwise(monkeypatch):
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    want = tie_rule(x, 9).sort(-1).values
    launched = []
    monkeypatch.setattr(tk, "topk_reference", lambda *a: launched.append("torch") or torch.topk(*a, sorted=False))
    monkeypatch.setattr(tk, "RESIDENT_MAX_N", 64)  # 100 entries pad to 128: too long for the resident kernel
    with pytest.raises(ValueError, match="RESIDENT_MAX_N"):
        tk.topk(x, 9, impl="triton", variant="resident")
    with pytest.raises(ValueError, match="variant='radix'"):  # auto goes to torch.topk, which has no chunk
        tk.topk(x, 9, impl="triton", block_n=32)
    _, idx = tk.topk(x, 9, impl="triton")
    assert launched == ["torch"] and torch.equal(idx.long().sort(-1).values, want)
    monkeypatch.setattr(tk, "RESIDENT_MAX_N", 128)
    with pytest.raises(ValueError, match="radix"):  # auto: now resident, which has no chunk
        tk.topk(x, 9, impl="triton", block_n=32)
    _, idx = tk.topk(x, 9, impl="triton")
    assert launched == ["torch"] and torch.equal(idx.long().sort(-1).values, want)


@variants
def test_ties_take_the_lowest_indices(poison, cfg):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (4, 150), generator=g).float().to(DEVICE)  # about 21 copies of each value
    for k in (1, 10, 21, 22, 75, 149, 150):
        check(x, k, **cfg)


@variants
def test_negative_values_and_signed_zeros(poison, cfg):
    g = torch.Generator().manual_seed(3)
    neg = -torch.rand(2, 90, generator=g) - 0.5  # all negative
    zeros = torch.where(torch.rand(2, 90, generator=g) < 0.5, -0.0, 0.0)  # -0.0 and +0.0 mixed: equal values
    x = torch.cat([neg, zeros, -neg], dim=-1).to(DEVICE)
    x[0, 100:110] = torch.tensor([-1e-30, 1e-30, -1e-45, 1e-45, -0.0, 0.0, -0.0, -3e38, 3e38, 0.0])
    for k in (1, 60, 90, 135, 180, 200, 270):
        check(x, k, **cfg)
    # k = 91: the 90 positives, then the lowest-index zero (a -0.0 or +0.0 alike)
    _, idx = check(x, 91, **cfg)
    first_zero = (x[1, 90:180] == 0).nonzero()[0, 0].item() + 90
    assert first_zero in idx[1].tolist()


@variants
def test_infinite_rows(poison, cfg):
    # built on the CPU and moved at the end, like the other tests' inputs: on CUDA, `x[1, [5, 66, 13]] = <CPU
    # tensor>` is an index_put_ whose 1-D CPU values torch does not move to the GPU (only 0-dim ones), so it raises
    x = torch.full((4, 70), NEG_INF)
    x[1, [5, 66, 13]] = torch.tensor([1.0, -2.0, 0.0])  # fewer finite entries than k
    x[2] = torch.randn(70, generator=torch.Generator().manual_seed(4))
    x[2, 3] = float("inf")
    x[3, ::2] = float("inf")  # 35 ties at +inf
    x = x.to(DEVICE)
    for k in (1, 3, 4, 20, 35, 36, 70):
        vals, idx = check(x, k, **cfg)
    vals, idx = check(x, 10, **cfg)
    assert idx[0].sort().values.tolist() == list(range(10))  # all -inf: the first k
    assert sorted(idx[1].tolist())[:3] == [0, 1, 2] and {5, 13, 66} <= set(idx[1].tolist())
    assert (vals[1] > NEG_INF).sum() == 3


@variants
def test_reference_impl_and_empty_cases(cfg):
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    vals, idx = tk.topk(x, 7)  # impl="reference" is the default
    assert idx.dtype == torch.int32 and torch.equal(vals, x.gather(-1, idx.long()))
    assert_same_set_as_torch(x, 7, idx)
    vals, idx = tk.topk(x, 0, impl="triton", **cfg)
    assert vals.shape == idx.shape == (3, 0)
    vals, idx = tk.topk(x[:0], 5, impl="triton", **cfg)
    assert vals.shape == idx.shape == (0, 5)


def test_bad_inputs_raise():
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="impl"):
        tk.topk(x, 3, impl="cuda")
    with pytest.raises(ValueError, match="fp32"):
        tk.topk(x.double(), 3, impl="triton")
    with pytest.raises(ValueError, match="fp32"):
        tk.topk(x[0, 0], 1, impl="triton")
    with pytest.raises(ValueError, match="k must be"):
        tk.topk(x, 17, impl="triton")
    with pytest.raises(ValueError, match="k must be"):
        tk.topk(x, -1, impl="triton")
    with pytest.raises(ValueError, match="contiguous"):
        tk.topk(x.t(), 1, impl="triton")
    with pytest.raises(ValueError, match="variant"):
        tk.topk(x, 3, impl="triton", variant="bitonic")
    with pytest.raises(ValueError, match="RADIX_BITS"):
        tk.topk(x, 3, impl="triton", variant="radix", radix_bits=16)
    with pytest.raises(ValueError, match="BLOCK_N"):
        tk.topk(x, 3, impl="triton", variant="radix", block_n=96)
    with pytest.raises(ValueError, match="radix_bits"):
        tk.topk(x, 3, impl="triton", variant="resident", radix_bits=8)


# ---------------------------------------------------------------------------------------------------------------
# The indexer's callers
# ---------------------------------------------------------------------------------------------------------------
def tie_free_scores(B, T, E, ratio, seed):
    """Masked indexer-like scores with distinct finite values (ReLU zeros would tie) and -inf where not visible."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, T, E, generator=g).to(DEVICE)
    return scores.masked_fill(~csa2.visible_mask(T, E, ratio, DEVICE), NEG_INF)


def test_select_topk_triton_equals_reference():
    scores = tie_free_scores(2, 40, 20, 2, seed=6)
    for k in (5, 20, 64):
        got = ix.select_topk(scores, k, impl="triton")
        want = ix.select_topk(scores, k)
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)  # same picks, -1 for the -inf ones
        mask = torch.zeros(*scores.shape[:2], scores.shape[-1] + 1, dtype=torch.bool, device=DEVICE)
        mask.scatter_(-1, torch.where(got < 0, scores.shape[-1], got).long(), True)
        assert torch.equal(mask[..., :-1], csa2.select_topk(scores, k))


def test_select_topk_over_pool_slots():
    B, T, E, bs = 1, 30, 30, 4
    scores = tie_free_scores(B, T, E, 1, seed=7)
    pool = ix.candidate_pool(scores, 1, bs, 3, impl="triton")
    slots = ix._pool_entries(pool, bs)  # [B, T, S] entry ids, negative for empty blocks
    ok = (slots >= 0) & (slots < E)
    slot_scores = torch.where(ok, scores.gather(-1, slots.clamp(0, E - 1)), NEG_INF).contiguous()
    got = ix.select_topk(slot_scores, 5, pool=pool, block_size=bs, impl="triton")
    want = ix.select_topk(slot_scores, 5, pool=pool, block_size=bs)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("block_size,topk_blocks", [(4, 3), (8, 100), (2, 7)])
def test_candidate_pool_triton_equals_model(block_size, topk_blocks):
    B, T, ratio = 2, 45, 1
    scores = tie_free_scores(B, T, T, ratio, seed=8)
    pool = ix.candidate_pool(scores, ratio, block_size, topk_blocks, impl="triton")
    want = ix.candidate_pool(scores, ratio, block_size, topk_blocks, impl="reference")
    assert torch.equal(pool.sort(-1).values, want.sort(-1).values)
    assert torch.equal(ix.pool_to_mask(pool, T, block_size), csa2.candidate_pool(scores, ratio, block_size,
                                                                                 topk_blocks))
