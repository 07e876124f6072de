"""Benchmark cases: Engram gather and fused gate (kernels/engram_triton.py) vs model.engram.Engram.

Size: N = 16384 tokens, C = 24 row ids per token, Dh = 256, D = 5120, n = 4 streams, bf16 activations. The table
here has ~2.4M rows (24 consecutive primes above 100,000; the flagship's 384M rows do not matter for a gather:
every read is a random 512 B row either way).
Ideal bytes: gather reads and writes N * C rows of Dh; the gate reads S (n rows), kv (n + 1 rows) and writes S'
(n rows) of D per token; its backward reads S, kv, dL/dS' and writes dL/dS, dL/dkv (5n + 2 rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import engram_triton as et
from kernels.fp8 import dequantize_fp8, quantize_fp8
from model.config import EngramConfig, ModelConfig
from model.engram import Engram

N, C, HEAD_DIM, DIM, NUM_STREAMS = 16384, 24, 256, 5120, 4
TABLE_PRIME_START = 100_000  # ~2.4M table rows

DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it


def _module() -> Engram:
    cfg = ModelConfig(dim=DIM, engram=EngramConfig(layers=[1], max_ngram=4, num_heads=8, head_dim=HEAD_DIM,
                                          prime_start=TABLE_PRIME_START, table_dtype="bfloat16"))
    with torch.device("meta"):
        m = Engram(cfg, 1)
    m.to_empty(device=DEVICE)
    m.init_weights()
    return m


def cases(sweep: bool = False) -> list[dict]:
    m = _module()
    n, D = NUM_STREAMS, DIM
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, m.num_rows, (N, C), device=DEVICE, generator=g)
    table = m.table.detach()
    values, scales = quantize_fp8(table)
    values_u8, scales_u8 = values.view(torch.uint8), scales.view(torch.uint8)
    S = torch.randn(N, n, D, device=DEVICE, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, (n + 1) * D, device=DEVICE, generator=g).to(torch.bfloat16)
    dead = torch.rand(N, device=DEVICE, generator=g) < 0.05
    qk = (m.q_weight * m.k_weight).detach()
    row_bytes = N * C * HEAD_DIM * 2

    def gather_fp8_baseline():
        rows = F.embedding(ids, values_u8).view(torch.float8_e4m3fn)
        return dequantize_fp8(rows, F.embedding(ids, scales_u8).view(torch.float8_e8m0fnu)).to(torch.bfloat16)

    def gate_baseline(S=S, kv=kv):  # Engram.forward after wkv
        S4, kv3 = S[None], kv[None]
        g = m.gate(S4, kv3[..., : n * D].unflatten(-1, (n, D)), dead[None])
        return (S4.float() + g[..., None] * kv3[..., n * D:].float()[:, :, None, :]).to(S.dtype)

    gate_bytes = N * (3 * n + 1) * D * 2
    out = [
        {"name": "engram/gather_bf16", "fn_triton": lambda: et.gather_rows(table, ids),
         "fn_baseline": lambda: F.embedding(ids, table), "bytes": 2 * row_bytes},
        {"name": "engram/gather_fp8", "fn_triton": lambda: et.gather_rows(values, ids, scales),
         "fn_baseline": gather_fp8_baseline, "bytes": row_bytes + row_bytes // 2 + N * C * HEAD_DIM // 32},
        {"name": "engram/gate_fwd", "fn_triton": lambda: et.gate_fwd(S, kv, qk, dead, m.eps),
         "fn_baseline": gate_baseline, "bytes": gate_bytes},
    ]
    # Backward: graphs built once; each timed call replays only the backward.
    graphs = {}
    for impl in ("triton", "reference"):
        leaves = [S.detach().requires_grad_(), kv.detach().requires_grad_()]
        if impl == "triton":
            s_out = et.gate_update(leaves[0], leaves[1], qk, dead, m.eps)
        else:
            s_out = gate_baseline(*leaves)[0]
        graphs[impl] = (s_out, leaves, torch.randn_like(s_out))

    def backward(impl):
        s_out, leaves, g_out = graphs[impl]
        return lambda: torch.autograd.grad(s_out, leaves, g_out, retain_graph=True)

    out.append({"name": "engram/gate_bwd", "fn_triton": backward("triton"), "fn_baseline": backward("reference"),
                "bytes": N * (5 * n + 2) * D * 2})
    if sweep:
        for block_r, block_d, warps in [(4, 512, 4), (4, 1024, 4), (4, 2048, 8), (8, 256, 4)]:
            out.append({"name": f"engram/gate_fwd/r{block_r}_d{block_d}_w{warps}",
                        "fn_triton": lambda a=(block_r, block_d, warps): et.gate_fwd(
                            S, kv, qk, dead, m.eps, block_r=a[0], block_d=a[1], num_warps=a[2]),
                        "fn_baseline": lambda: None, "sweep": True, "bytes": gate_bytes})
    return out
