"""Benchmark cases for `kernels.sparse_attention` at the flagship decoder shape.

B=1, T=32768, H=64, D=512, window 128, K=512 top-k entries out of E=T compressed entries (ratio 1), bf16; random
distinct visible entries per query. Useful FLOPs: 4*B*T*H*D*(128+512) forward (QK^T and PV over every key a query
attends to), 2.5x that backward (QK^T recompute, dO.V, dQ, dK, dV). Targets: forward >= 350, backward >= 200
TFLOP/s. The baseline is the naive gather-based PyTorch reference (`impl="reference"`); its backward is autograd
through it and holds ~68 GiB while its case runs, so on an 80 GB H100 it is skipped with a one-line reason (the
Triton rows still print). The "bwd/<setting>" cases time the backward's switches (kernels/sparse_attention.py) on
the same retained graph, Triton only. Inputs are built on the first call; one retained backward
graph is kept at a time (building another drops the previous one), so the cases fit the GPU one after the other.

Measured (bench/kernels.py, one H200, torch 2.11 / triton 3.6, bf16 matmul 776 TFLOP/s): forward 11.8 ms =
233 TFLOP/s (4.2x the baseline), backward 42.8 ms = 160 TFLOP/s (4.1x). Both miss their targets; the reasons are
in kernels/sparse_attention_fwd.py (duplicated QK^T tiles) and kernels/sparse_attention_bwd.py (the per-query dkv
writes).

The inference-cache case (`fwd_fp8win_fp4cmp`) is the same forward with kv_win in FP8 (e4m3 + e8m0 per 32) and
kv_cmp in FP4 (E2M1 + e4m3 per 16): the Triton path dequantises both into bf16 (one Triton pass each) and then runs
the plain kernel; its baseline dequantises both with the PyTorch references and then runs the gather-based
reference. Same useful FLOPs as the bf16 forward, so the two rows compare directly and the difference is the
dequantisation pass: 11.53 ms against 11.42 ms on the H200 (2026-11-30). A decode inside the kernel as each key tile
was loaded ran 86.9 ms and was removed (kernels/sparse_attention.py says why).

sweep=True adds the launch variants of kernels/sparse_attention.py (FWD_CONFIG: BLOCK_N, (num_warps, num_stages);
BWD_CONFIG: the dq / dkv launches), named by their overrides, e.g. "sparse_attention/fwd/BLOCK_N=64,fwd=8x1". The
backward sweep cases reuse the one retained graph of "bwd" (the config is read at backward time). The forward's
SPLIT_D and PIPE variants and the backward's key-centric window gradient and chained dkv dots lost the H200 sweep of
2026-11-30 (BENCHMARKS.md) and were removed.
"""

from __future__ import annotations

import functools

import torch

import kernels.sparse_attention as sa
from kernels import fp4, fp8

B, T, H, D, WINDOW, TOPK = 1, 32768, 64, 512, 128, 512
FWD_FLOPS = 4 * B * T * H * D * (WINDOW + TOPK)
DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it
_GRAPH: dict = {}  # the one retained backward graph: key -> (out, leaves, grad)


def random_topk(batch: int, num_queries: int, num_entries: int, k: int, ratio: int, device, chunk: int = 4096):
    """Distinct random visible entries per query ([B, T, K] int32, -1 where fewer than K are visible)."""
    out = torch.empty(batch, num_queries, k, dtype=torch.int32, device=device)
    e = torch.arange(num_entries, device=device)
    for t0 in range(0, num_queries, chunk):
        t = torch.arange(t0, min(num_queries, t0 + chunk), device=device)
        vis = e[None, :] < ((t + 1) // ratio)[:, None]
        r = torch.rand(batch, len(t), num_entries, device=device).masked_fill(~vis, -1.0)
        vals, idx = r.topk(k, dim=-1, sorted=False)
        out[:, t0 : t0 + len(t)] = torch.where(vals >= 0, idx, -1).to(torch.int32)
    return out


@functools.lru_cache(maxsize=1)
def _inputs():
    torch.manual_seed(0)
    dev = DEVICE
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    kv_win = torch.randn(B, T, D, device=dev, dtype=torch.bfloat16)
    kv_cmp = torch.randn(B, T, D, device=dev, dtype=torch.bfloat16)
    sink = torch.randn(H, device=dev, dtype=torch.float32)
    idx = random_topk(B, T, T, TOPK, 1, dev)
    return q, kv_win, kv_cmp, idx, sink


def _forward(impl: str):
    q, kv_win, kv_cmp, idx, sink = _inputs()
    return sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, WINDOW, impl=impl)


@functools.lru_cache(maxsize=1)
def _quantised_kv():
    """(FP8 kv_win, FP4 kv_cmp) of the bf16 inputs, in the inference cache's formats (SPEC 1.4)."""
    _, kv_win, kv_cmp, _, _ = _inputs()
    return fp8.quantize_fp8(kv_win, sa.FP8_BLOCK), fp4.quantize(kv_cmp, sa.FP4_BLOCK, "e4m3")


def _forward_quantised(impl: str):
    q, _, _, idx, sink = _inputs()
    kv_win, kv_cmp = _quantised_kv()
    return sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, WINDOW, impl=impl)


# Autograd through the gather-based reference keeps ~34x q's bytes beyond the inputs (the gathered [T, K, D] keys,
# the fp32 logits and probabilities, and in the backward the keys' gradients from both einsums): 68 GiB at this
# shape, which is why this case ran out of memory on an 80 GB H100 (measured on the CPU at T = 512 and 1,024:
# 34.1x and 32.8x). The Triton backward needs ~9.3 GiB in all here (`triton_backward_bytes`).
REFERENCE_BWD_FACTOR = 34


def triton_backward_bytes() -> int:
    """Peak bytes of the Triton backward case at this shape: q, out, its gradient and dq (B*T*H*D each, bf16), the
    P / dS scratch (BWD_CONFIG["scratch_bytes"], 1 GiB), the fp32 key gradients and the stacked keys ((B*T + B*E)
    rows of D), the top-k ids."""
    rows = B * T + B * T  # kv_win and kv_cmp (E = T) stacked
    return 4 * B * T * H * D * 2 + sa.BWD_CONFIG["scratch_bytes"] + rows * D * (4 + 2 + 2) + B * T * TOPK * 4


def _backward(impl: str):
    """A closure that runs only the backward; the forward graph is built at its first call and retained."""

    def run():
        if impl not in _GRAPH:
            _GRAPH.clear()
            torch.cuda.empty_cache()
            if impl == "reference":
                need, free = REFERENCE_BWD_FACTOR * B * T * H * D * 2, torch.cuda.mem_get_info()[0]
                if 1.15 * need > free:  # the allocator's rounding of ~16 GiB blocks needs headroom
                    raise MemoryError(f"skipped: autograd through the reference needs ~{need / 2**30:.0f} GiB, "
                                      f"{free / 2**30:.0f} GiB free")
            q, kv_win, kv_cmp, idx, sink = _inputs()
            leaves = [t.detach().requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
            out = sa.sparse_attention(leaves[0], leaves[1], leaves[2], idx, leaves[3], WINDOW, impl=impl)
            _GRAPH[impl] = (out, leaves, torch.randn_like(out))
        out, leaves, grad = _GRAPH[impl]
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    return run


def _with_config(config: dict, overrides: dict, fn):
    """fn run with `overrides` set in a launch-config dict (FWD_CONFIG / BWD_CONFIG), restored afterwards."""

    def run():
        old = dict(config)
        config.update(overrides)
        try:
            return fn()
        finally:
            config.clear()
            config.update(old)

    return run


def _name(overrides: dict) -> str:
    return ",".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in overrides.items())


# Sweep configurations (plus compilation). Shared memory, since the key tiles are not pipelined into async copies
# (TTGIR for sm_90): q 64 KB plus one buffer per key-tile load.
_FWD_SWEEP = [
    {"BLOCK_N": 32},  # the pre-existing sweep case
    {"BLOCK_N": 64, "fwd": (8, 1)},
    {"BLOCK_N": 128, "fwd": (8, 1)},
    {"BLOCK_N": 32, "fwd": (8, 3)},
]
_BWD_SWEEP = [
    {"dkv": (8, 1)},
    {"dq": (8, 1)},
]
_BWD_SWITCHES = {
    "prev": {"stacked_probs": False, "split_loads": False},
    "stacked_probs_only": {"stacked_probs": True, "split_loads": False},
    "split_loads_only": {"stacked_probs": False, "split_loads": True},
    "dkv_one_stage": {"dkv": (8, 1)},  # 192 KB of shared memory, where the default's two stages take 224 of 227
    "probs_n32_pipelined": {"probs_block_n": 32, "probs": (8, 2)},
    "dkv_overlap_half": {"dkv_overlap": True, "dkv_sm_share": 0.5},
    "dkv_overlap_third": {"dkv_overlap": True, "dkv_sm_share": 0.33},
}


def cases(sweep: bool = False) -> list[dict]:
    out = [
        {"name": "sparse_attention/fwd", "fn_triton": lambda: _forward("triton"),
         "fn_baseline": lambda: _forward("reference"), "flops": FWD_FLOPS},
        # before the backward cases, so its baseline does not run beside a retained backward graph
        {"name": "sparse_attention/fwd_fp8win_fp4cmp", "fn_triton": lambda: _forward_quantised("triton"),
         "fn_baseline": lambda: _forward_quantised("reference"), "flops": FWD_FLOPS},
        {"name": "sparse_attention/bwd", "fn_triton": _backward("triton"), "fn_baseline": _backward("reference"),
         "flops": int(2.5 * FWD_FLOPS)},
    ]
    # The backward's switches side by side on the retained graph of "bwd" (Triton only): the previous kernels
    # (both off, 179-182 TFLOP/s on the H200) and each switch alone.
    for label, overrides in _BWD_SWITCHES.items():
        out.append({"name": f"sparse_attention/bwd/{label}", "fn_baseline": None, "flops": int(2.5 * FWD_FLOPS),
                    "fn_triton": _with_config(sa.BWD_CONFIG, overrides, _backward("triton"))})
    if sweep:
        noop = lambda: None  # noqa: E731
        runs = [("fwd", sa.FWD_CONFIG, _FWD_SWEEP, lambda: _forward("triton"), FWD_FLOPS),
                ("bwd", sa.BWD_CONFIG, _BWD_SWEEP, _backward("triton"), int(2.5 * FWD_FLOPS))]
        for what, config, sweep_list, fn, flops in runs:
            for overrides in sweep_list:
                out.append({"name": f"sparse_attention/{what}/{_name(overrides)}", "sweep": True, "flops": flops,
                            "fn_triton": _with_config(config, overrides, fn), "fn_baseline": noop})
    return out
