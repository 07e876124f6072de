"""Benchmark cases: the single-pass mHC step (kernels/mhc_triton.py, coefficients in kernels/mhc_coeffs_triton.py)
vs model.mhc.single_pass.

Size: N = 16384 tokens, n = 4 streams, D = 5120, bf16 streams (target: >= 70% of copy bandwidth).
Sweep (sweep=True): every forward tile configuration of kernels.mhc_triton.FWD_CONFIGS (the default, the previous
default, that one with split_d / stream / sq_tile on, the smallest tile), the coefficient kernel alone forward and
backward (mhc/coeffs_*, kernels.mhc_coeffs_triton against the PyTorch coefficient ops), and two backward tiles.
CPU dry run: set DEVICE = "cpu" and small N / DIM here, TRITON_INTERPRET=1, then call every case's functions.
Ideal bytes, forward: (n + 1) reads + (n + 1) writes of D-wide bf16 rows per token (the per-token mix matrix,
sum_sq and raw logits are < 0.2% on top). Backward: y, S, dL/dS', dL/dx read and dL/dy, dL/dS written,
(3n + 3) rows (the kernels also read S' once more for dL/dfn: not counted, so the figure shows that overhead).
"""

from __future__ import annotations

import torch

from kernels import mhc_coeffs_triton, mhc_triton
from model import kernels as kern
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
    site_kw = dict(dim=site.dim, norm_eps=site.norm_eps, eps=site.eps, sinkhorn_iters=site.sinkhorn_iters)
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
        {"name": "mhc/single_pass", "fn_triton": lambda: kern.mhc_single_pass(y, S, coeffs, pre_lag, site),
         "fn_baseline": lambda: mhc.single_pass(y, S, coeffs, pre_lag, site), "bytes": fwd_bytes},
    ]
    # Backward: graphs built once, each timed call replays only the backward.
    grads = {}
    for impl, step in (("triton", kern.mhc_single_pass), ("reference", mhc.single_pass)):
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
        # Every named forward configuration (kernels.mhc_triton.FWD_CONFIGS; pick FWD_DEFAULT from these).
        for name in mhc_triton.FWD_CONFIGS:
            out.append({"name": f"mhc/step_fwd_kernel/{name}",
                        "fn_triton": lambda c=name: mhc_triton.mhc_step_fwd(y2, S3, mix, fn, config=c),
                        "fn_baseline": lambda: None, "sweep": True, "bytes": fwd_bytes})
        # The next site's coefficients from the statistics: one Triton launch each way vs the PyTorch ops.
        _, _, sumsq, raw = mhc_triton.mhc_step_fwd(y2, S3, mix, fn)
        with torch.no_grad():  # forward only, no graph: the cases below time the backward
            c_fwd = (lambda: mhc_coeffs_triton.next_coeffs(raw, sumsq, site.scale, site.base, **site_kw),
                     lambda: site.coeffs_from_logits(raw * torch.rsqrt(sumsq[:, None] / (n * DIM) + site.norm_eps)))
        out.append({"name": "mhc/coeffs_fwd", "fn_triton": torch.no_grad()(c_fwd[0]),
                    "fn_baseline": torch.no_grad()(c_fwd[1]), "sweep": True, "bytes": N * (M + 1 + M) * 4})
        raw, sumsq = raw.requires_grad_(), sumsq.requires_grad_()
        c_tri = mhc_coeffs_triton.next_coeffs(raw, sumsq, site.scale, site.base, **site_kw)
        c_ref = site.coeffs_from_logits(raw * torch.rsqrt(sumsq[:, None] / (n * DIM) + site.norm_eps))
        g_c = [torch.randn_like(t) for t in c_ref]
        leaves_c = [raw, sumsq, site.scale, site.base]
        out.append({"name": "mhc/coeffs_bwd",
                    "fn_triton": lambda: torch.autograd.grad(c_tri, leaves_c, g_c, retain_graph=True),
                    "fn_baseline": lambda: torch.autograd.grad(c_ref, leaves_c, g_c, retain_graph=True),
                    "sweep": True, "bytes": N * (M + 1 + 2 * M + 1) * 4})
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
