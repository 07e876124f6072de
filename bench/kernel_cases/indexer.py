"""Benchmark cases for `kernels.indexer` at 128K context.

The last chunk of T=4096 queries of a 131072-token sequence (ratio 1, so E=131072 entries, q_offset=E-T: every query
sees almost every entry), Hi=32 heads, Di=128, bf16 q/k, fp32 head weights. Useful FLOPs: 2*Hi*Di per visible
(query, entry) pair; target >= 50% of the tensor-core bound, i.e. of the measured bf16 matmul rate.

- indexer/scores_fwd_128k: dense scores. Baseline: a per-head loop of cuBLAS bf16 matmuls with the ReLU and the
  weighted sum in PyTorch (the fp32 einsum reference would need a 68 GB intermediate at this size).
- indexer/pool_fwd_128k: Reindex scoring of each query's pool of 2048 blocks x 8 = 16384 entries (the pool is built
  once by `candidate_pool` from the dense scores). Baseline: the gather-based reference (about 45 GB transient).
- indexer/scores_bwd_32k: backward of the dense scores at 32K context (T=4096, E=32768) against autograd through
  the per-head baseline (at 128K its saved activations would not fit). Useful FLOPs: dq and dk, 2x the forward.
One retained backward graph is kept at a time, as in the attention cases.

Measured (bench/kernels.py, one H200, torch 2.11 / triton 3.6, bf16 matmul 783 TFLOP/s): dense forward 8.3 ms =
519 TFLOP/s = 66% of the matmul rate (23x the baseline); pool forward 2.6 ms = 211 TFLOP/s (26x; gathered keys, so
L2-bound: 4 MB of keys per query); dense backward 15.2 ms = 136 TFLOP/s (3.6x).
"""

from __future__ import annotations

import functools

import torch

import kernels.indexer as ix

HI, DI, T, BS, POOL_BLOCKS = 32, 128, 4096, 8, 2048
E_128K, E_32K = 131072, 32768
DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it
_GRAPH: dict = {}


@functools.lru_cache(maxsize=2)
def _inputs(num_entries: int):
    torch.manual_seed(0)
    dev = DEVICE
    q = torch.randn(1, T, HI, DI, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1, T, HI, device=dev, dtype=torch.float32) * HI ** -0.5
    k = torch.randn(1, num_entries, DI, device=dev, dtype=torch.bfloat16)
    return q, w, k, num_entries - T


def _baseline_scores(q, w, k, q_offset):
    """Per-head bf16 matmuls, fp32 ReLU-weighted sum, causal mask: the plain-PyTorch way to score 128K entries."""
    E = k.shape[1]
    scores = torch.zeros(1, T, E, device=q.device, dtype=torch.float32)
    for h in range(HI):
        d = torch.matmul(q[:, :, h], k.transpose(1, 2)).float()
        scores = scores + d.relu() * w[:, :, h, None]
    scores = scores * DI ** -0.5
    p = torch.arange(T, device=q.device) + q_offset
    return scores.masked_fill(torch.arange(E, device=q.device)[None, :] >= (p + 1)[:, None], float("-inf"))


def _dense(impl: str, num_entries: int = E_128K):
    q, w, k, off = _inputs(num_entries)
    if impl == "triton":
        return ix.index_scores(q, w, k, 1, q_offset=off, impl="triton")
    return _baseline_scores(q, w, k, off)


@functools.lru_cache(maxsize=1)
def _pool():
    q, w, k, off = _inputs(E_128K)
    return ix.candidate_pool(_dense("triton"), 1, BS, POOL_BLOCKS, q_offset=off, impl="triton")


def _pool_scores(impl: str):
    q, w, k, off = _inputs(E_128K)
    return ix.index_scores_pool(q, w, k, _pool(), 1, BS, q_offset=off, impl=impl)


def _backward(impl: str, num_entries: int):
    def run():
        if impl not in _GRAPH:
            _GRAPH.clear()
            torch.cuda.empty_cache()
            q, w, k, off = _inputs(num_entries)
            leaves = [t.detach().requires_grad_() for t in (q, w, k)]
            if impl == "triton":
                out = ix.index_scores(*leaves, 1, q_offset=off, impl="triton")
            else:
                out = _baseline_scores(*leaves, off)
            _GRAPH[impl] = (out, leaves, torch.randn_like(out))
        out, leaves, grad = _GRAPH[impl]
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    return run


def _visible_pairs(num_entries: int) -> int:
    off = num_entries - T
    return sum(min(num_entries, off + t + 1) for t in range(T))


def cases(sweep: bool = False) -> list[dict]:
    out = [
        {"name": "indexer/scores_fwd_128k", "fn_triton": lambda: _dense("triton"),
         "fn_baseline": lambda: _dense("baseline"), "flops": 2 * HI * DI * _visible_pairs(E_128K)},
        {"name": "indexer/pool_fwd_128k", "fn_triton": lambda: _pool_scores("triton"),
         "fn_baseline": lambda: _pool_scores("reference"), "flops": 2 * HI * DI * T * POOL_BLOCKS * BS},
        {"name": "indexer/scores_bwd_32k", "fn_triton": _backward("triton", E_32K),
         "fn_baseline": _backward("baseline", E_32K), "flops": 2 * 2 * HI * DI * _visible_pairs(E_32K)},
    ]
    if sweep:  # another tile shape of the dense forward
        def wide():
            old = dict(ix.SCORES_CONFIG["fwd"])
            ix.SCORES_CONFIG["fwd"].update(BLOCK_T=64, BLOCK_E=256)
            try:
                return _dense("triton")
            finally:
                ix.SCORES_CONFIG["fwd"].update(old)

        out.append({"name": "indexer/scores_fwd_128k/BLOCK_T=64,BLOCK_E=256", "sweep": True, "fn_triton": wide,
                    "fn_baseline": lambda: None, "flops": out[0]["flops"]})
    return out
