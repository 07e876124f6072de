"""Proves the wiring of the fused RMSNorm + RoPE + fake-quant kernel (kernels/norm_rope_fp4.py) into the model
through `model.kernels.norm_rope_quant` (the whole model on both paths: tests/model/test_kernels_switch.py):

- the modules' pre-norm outputs (`Compressor(norm=False)`, `Indexer.keys(norm=False)`) followed by their norm are
  their normed outputs bit for bit, so the reference path computes what it did before the kernel was wired in;
- `norm_rope_quant` on the reference path is the model's composition (norm module -> apply_rope -> fake-quant) bit
  for bit and launches no fused kernel; on the triton path it launches the kernel once and equals the reference
  bit for bit at every site's shape and format (SWA KV FP8, main KV FP4 e4m3/16, indexer keys FP4 ue8m0/32 with a
  norm, indexer queries [B, T, Hi, Di] without one, each also unquantised, RoPE on the last channels only), on rows
  whose sum of squares is exact in any order (the kernel's one unreproduced rounding, see its docstring); the
  normed rows it returns are detached, and the gradients of x and the norm's weight agree within fp32 rounding;
- RoPE alone (no norm, no quantiser) stays `apply_rope`: nothing to fuse;

The rest of what it proves: docs/testing.md#norm-rope-and-quantisation-wiring
"""

from __future__ import annotations

import pytest
import torch

from model import kernels as kern
from model.common import RMSNorm
from model.csa2 import Compressor, Indexer
from model.rope import apply_rope
from tests.distributed import run_distributed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (quant, shape, with a norm): the model's sites at the tiny config's sizes (D 64, Di 32, Hi 4, rope_dim 16); T = 13
SITES = [
    ("fp8", (2, 13, 64), True),  # SWA KV: wkv -> kv_norm -> RoPE -> FP8
    (None, (2, 13, 64), True),  # SWA KV, QAT off
    ("fp4", (2, 13, 64), True),  # main KV: compressor's latent -> its norm -> RoPE -> FP4 e4m3/16
    ("fp4_ue8m0", (2, 13, 32), True),  # indexer keys: wk -> k_norm -> RoPE -> FP4 ue8m0/32
    (None, (2, 13, 32), True),  # indexer keys, QAT off
    ("fp4_ue8m0", (2, 13, 4, 32), False),  # indexer queries: RoPE -> FP4, heads share a token's tables
]
ROPE_DIM = 16


def _exact_rows(shape, seed: int) -> torch.Tensor:
    """Small integers times powers of two: every partial sum of squares is exact in fp32, so the kernel's and
    torch's statistics agree to the bit (as tests/kernels/test_norm_rope_fp4.py)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-15, 16, shape, generator=g).float()
    e = torch.randint(-3, 3, (*shape[:-1], 1), generator=g).float()
    return (m * torch.exp2(e)).to(DEVICE)


def _site(shape, with_norm: bool, seed: int = 0):
    x = _exact_rows(shape, seed).requires_grad_()
    norm = None
    if with_norm:
        norm = RMSNorm(shape[-1], 1e-6).to(DEVICE)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(shape[-1], generator=torch.Generator().manual_seed(seed + 1)) + 0.5)
    angles = torch.arange(shape[1], dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, ROPE_DIM // 2)
    return x, norm, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


class _Spy:
    """Counts the fused kernel's launches (kernels.norm_rope_fp4.norm_rope_fake_quant, as model.kernels calls it)."""

    def __init__(self, monkeypatch):
        from kernels import norm_rope_fp4

        self.calls = []
        real = norm_rope_fp4.norm_rope_fake_quant

        def spy(*args, **kwargs):
            self.calls.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(norm_rope_fp4, "norm_rope_fake_quant", spy)


def _composed(x, norm, cos, sin, quant):
    """The model's three steps as it ran them before the fused kernel (model/attention.py)."""
    y = x if norm is None else norm(x)
    q = apply_rope(y, cos, sin)
    if quant == "fp8":
        q = kern.fake_quant_fp8(q, 32, "reference")
    elif quant == "fp4":
        q = kern.fake_quant_fp4(q, 16, "e4m3", "reference")
    elif quant == "fp4_ue8m0":
        q = kern.fake_quant_fp4(q, 32, "ue8m0", "reference")
    return q, y


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_without_norm_then_norm_is_the_compressor(ratio):
    comp = Compressor(dim=24, latent_dim=16, ratio=ratio, eps=1e-6)
    comp.init_weights(0.3)
    with torch.no_grad():
        comp.norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 9, 24)
    assert torch.equal(comp.norm(comp(h, norm=False)), comp(h))


def test_indexer_keys_without_norm_then_norm_are_the_keys():
    idx = Indexer(dim=24, q_lora_rank=8, latent_dim=16, num_heads=2, head_dim=32, owns_keys=True, eps=1e-6)
    idx.init_weights(0.3)
    with torch.no_grad():
        idx.k_norm.weight.uniform_(0.5, 1.5)
    latent = torch.randn(2, 5, 16)
    assert torch.equal(idx.k_norm(idx.keys(latent, norm=False)), idx.keys(latent))


@pytest.mark.parametrize("quant, shape, with_norm", SITES)
def test_reference_path_is_the_composition(quant, shape, with_norm, monkeypatch):
    spy = _Spy(monkeypatch)
    x, norm, cos, sin = _site(shape, with_norm)
    q, y = kern.norm_rope_quant(x, norm, cos, sin, quant, "reference", return_normed=True)
    want, want_y = _composed(x, norm, cos, sin, quant)
    assert torch.equal(q, want) and torch.equal(y, want_y) and not y.requires_grad
    assert not spy.calls


@pytest.mark.parametrize("quant, shape, with_norm", SITES)
def test_triton_path_runs_the_fused_kernel_and_equals_the_reference(quant, shape, with_norm, monkeypatch):
    spy = _Spy(monkeypatch)
    x, norm, cos, sin = _site(shape, with_norm)
    q_ref, y_ref = kern.norm_rope_quant(x, norm, cos, sin, quant, "reference", return_normed=True)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    params = [x] + ([norm.weight] if norm is not None else [])
    grads_ref = torch.autograd.grad(q_ref, params, g)
    assert not spy.calls
    q, y = kern.norm_rope_quant(x, norm, cos, sin, quant, "triton", return_normed=True)
    assert len(spy.calls) == 1 and spy.calls[0]["quant"] == quant and spy.calls[0]["impl"] == "triton"
    assert torch.equal(q, q_ref) and torch.equal(y, y_ref) and not y.requires_grad
    for got, want in zip(torch.autograd.grad(q, params, g), grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # without return_normed: the rows alone
    assert torch.equal(kern.norm_rope_quant(x, norm, cos, sin, quant, "triton"), q_ref)


def test_rope_alone_is_not_fused(monkeypatch):
    spy = _Spy(monkeypatch)
    x, _, cos, sin = _site((2, 13, 4, 32), with_norm=False)
    assert torch.equal(kern.norm_rope_quant(x, None, cos, sin, None, "triton"), apply_rope(x, cos, sin))
    assert not spy.calls


def _dtensor_norm_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from kernels import norm_rope_fp4
    from trainer.parallel.tensor import ReplicateParallel

    calls = []
    real = norm_rope_fp4.norm_rope_fake_quant
    norm_rope_fp4.norm_rope_fake_quant = lambda *a, **k: calls.append(k) or real(*a, **k)
    x, norm, cos, sin = _site((2, 13, 64), with_norm=True)
    want = _composed(x, norm, cos, sin, "fp8")[0]
    # the plan's style for kv_norm: a replicated DTensor weight, hooks that hand back a local output
    parallelize_module(norm, init_device_mesh(DEVICE, (world_size,)), ReplicateParallel(partial_output_grad=True))
    got = kern.norm_rope_quant(x, norm, cos, sin, "fp8", "triton")
    got.sum().backward()
    return {"fuses": kern.fuses_norm(norm, "triton"), "calls": len(calls), "equal": torch.equal(got, want),
            "local": not kern.plain(norm.weight) and kern.plain(got), "grad": norm.weight.grad is not None}


def test_dtensor_norm_is_not_fused():
    (result,) = run_distributed(_dtensor_norm_worker, 1, backend="cuda:nccl,cpu:gloo" if DEVICE == "cuda" else "gloo")
    assert result == {"fuses": False, "calls": 0, "equal": True, "local": True, "grad": True}
