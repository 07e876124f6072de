"""Benchmark cases: the single-pass mHC step (kernels/mhc_triton.py) vs model.mhc.single_pass.

Size: N = 16384 tokens, n = 4 streams, D = 5120, bf16 streams (target: >= 70% of copy bandwidth).
Ideal bytes, forward: (n + 1) reads + (n + 1) writes of D-wide bf16 rows per token (the per-token mix matrix,
sum_sq and raw logits are < 0.2% on top). Backward: y, S, dL/dS', dL/dx read and dL/dy, dL/dS written,
(3n + 3) rows (the kernels also read S' once more for dL/dfn: not counted, so the figure shows that overhead).
"""

from __future__ import annotations

import torch

from kernels import mhc_triton
from model import mhc
from model.config import MHCConfig

N, NUM_STREAMS, DIM = 16384, 4, 5120

DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it


def _inputs():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    n, M = NUM_STREAMS, 2 * NUM_STREAMS + NUM_STREAMS**2
    S = torch.randn(1, N, n, DIM, device=DEVICE, generator=g).to(torch.bfloat16)
    y = torch.randn(1, N, DIM, device=DEVICE, generator=g).to(torch.bfloat16)
    post = torch.rand(1, N, n, device=DEVICE, generator=g) * 2
    comb = torch.softmax(torch.randn(1, N, n, n, device=DEVICE, generator=g), -1)
    pre_lag = torch.rand(1, N, n, device=DEVICE, generator=g)
    site = mhc.HCSite(DIM, MHCConfig(num_streams=n), norm_eps=1e-20).to(DEVICE)
    site.init_weights(0.02)
    return y, S, mhc.Coeffs(None, post, comb), pre_lag, site, M


def cases(sweep: bool = False) -> list[dict]:
    y, S, coeffs, pre_lag, site, M = _inputs()
    n = NUM_STREAMS
    row = DIM * 2  # one bf16 D-wide row
    mix = mhc.mix_matrix(pre_lag, coeffs.post, coeffs.comb).reshape(N, n + 1, n + 1).contiguous()
    y2, S3, fn = y.reshape(N, DIM), S.reshape(N, n, DIM), site.fn.detach()

    def baseline_kernel():  # the reference's fused formulation, from the same mix matrix
        out = mix[:, :, :1] * y2.float()[:, None] + torch.matmul(mix[:, :, 1:], S3.float())
        s_new = out[:, :n].to(torch.bfloat16)
        u = s_new.float().flatten(1)
        return s_new, out[:, n].to(torch.bfloat16), u.square().sum(1), u @ fn.t()

    fwd_bytes = N * (2 * (n + 1) * row + (n + 1) ** 2 * 4 + (M + 1) * 4)
    out = [
        {"name": "mhc/step_fwd_kernel", "fn_triton": lambda: mhc_triton.mhc_step_fwd(y2, S3, mix, fn),
         "fn_baseline": baseline_kernel, "bytes": fwd_bytes},
        {"name": "mhc/single_pass", "fn_triton": lambda: mhc_triton.single_pass(y, S, coeffs, pre_lag, site),
         "fn_baseline": lambda: mhc.single_pass(y, S, coeffs, pre_lag, site), "bytes": fwd_bytes},
    ]
    # Backward: graphs built once, each timed call replays only the backward.
    grads = {}
    for impl, step in (("triton", mhc_triton.single_pass), ("reference", mhc.single_pass)):
        leaves = [t.detach().requires_grad_() for t in (y, S)]
        s_new, x, c = step(leaves[0], leaves[1], coeffs, pre_lag, site)
        outs = (s_new, x, c.pre, c.post, c.comb)
        grads[impl] = (outs, leaves, [torch.randn_like(t) for t in outs])
    bwd_bytes = N * (3 * n + 3) * row

    def backward(impl):
        outs, leaves, g = grads[impl]
        return lambda: torch.autograd.grad(outs, leaves + [site.fn], g, retain_graph=True)

    out.append({"name": "mhc/single_pass_bwd", "fn_triton": backward("triton"),
                "fn_baseline": backward("reference"), "bytes": bwd_bytes})
    if sweep:
        for bt, bd, warps, stages in [(64, 32, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 64, 8, 2),
                                      (16, 128, 8, 2), (128, 16, 8, 2)]:
            out.append({"name": f"mhc/step_fwd_kernel/t{bt}_d{bd}_w{warps}_s{stages}",
                        "fn_triton": lambda a=(bt, bd, warps, stages): mhc_triton.mhc_step_fwd(
                            y2, S3, mix, fn, block_t=a[0], block_d=a[1], num_warps=a[2], num_stages=a[3]),
                        "fn_baseline": lambda: None, "sweep": True, "bytes": fwd_bytes})
        s_new = mhc_triton.mhc_step_fwd(y2, S3, mix, fn)[0]
        g_s, g_x = torch.randn_like(S3), torch.randn_like(y2)
        g_sumsq, g_raw = torch.randn(N, device=DEVICE), torch.randn(N, M, device=DEVICE)
        for bt, bd, warps in [(16, 128, 8), (32, 64, 8)]:
            out.append({"name": f"mhc/step_bwd_kernel/t{bt}_d{bd}_w{warps}",
                        "fn_triton": lambda a=(bt, bd, warps): mhc_triton.mhc_step_bwd(
                            y2, S3, mix, fn, s_new, g_s, g_x, g_sumsq, g_raw,
                            block_t=a[0], block_d=a[1], num_warps=a[2]),
                        "fn_baseline": lambda: None, "sweep": True, "bytes": bwd_bytes})
    return out
