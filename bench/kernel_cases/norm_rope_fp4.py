"""Benchmark cases: fused RMSNorm + RoPE + block (fake-)quantisation (kernels/norm_rope_fp4.py) vs the model's three
passes (model.common.RMSNorm, model.rope.apply_rope, then the Triton fake-quant the model's triton path calls today).

Sizes: ROWS = 32768 rows of the 512-wide latent (main KV "fp4", SWA KV "fp8", or no quantiser: QAT off), the
indexer keys [32768, 128] ("fp4_ue8m0", k_norm) and the indexer queries [1, 4096, 32, 128] ("fp4_ue8m0", no norm),
bf16 rows and tables, RoPE on the last 64 channels.
Ideal bytes per row of D bf16 channels (the weight and cos/sin tables are < 1% and not counted):
    fake quant (training forward)   2D read + 2D written (+ 2D for the pre-RoPE latent the compressor site also
                                    returns, + 4 B rstd saved for the backward)
    record (inference)              2D read + D/2 + D/block written (fp4), D + D/32 (fp8)
    backward                        2D (dq) + 2D (x) read + 4 B rstd, 2D (dx) written
The unfused baseline moves at least three times the forward's ideal (three read-and-write passes, 12D per row),
in practice ~13x: torch's RMSNorm makes four fp32 temporaries of the row and RoPE a cat of it (~40D per row).
"""

from __future__ import annotations

import torch

from kernels import fp4, fp8
from kernels import norm_rope_fp4 as nr
from model.common import RMSNorm
from model.rope import apply_rope

ROWS, DIM, INDEX_DIM, INDEX_HEADS, INDEX_TOKENS, ROPE_DIM = 32768, 512, 128, 32, 4096, 64

DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it


def _unfused(x, norm, cos, sin, quant):
    """The model's path before this kernel: torch norm and RoPE, then the Triton fake-quant (kernels.fp4_triton)."""
    r = apply_rope(x if norm is None else norm(x), cos, sin)
    if quant == "fp8":
        return fp8.fake_quant_fp8(r, 32, impl="triton")
    if quant is None:
        return r
    block, scale_fmt = nr.QUANTS[quant]
    return fp4.fake_quant(r, block, scale_fmt, impl="triton")


def _norm(norm) -> dict:
    """An RMSNorm module as the kernels take it: its weight and eps (nothing without a norm)."""
    return {} if norm is None else dict(weight=norm.weight, eps=norm.eps)


def _inputs(shape, with_norm, g):
    x = torch.randn(shape, device=DEVICE, generator=g).to(torch.bfloat16)
    norm = None
    if with_norm:
        norm = RMSNorm(shape[-1], 1e-6).to(DEVICE)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(shape[-1], device=DEVICE, generator=g) + 0.5)
    ang = torch.rand(shape[1], ROPE_DIM // 2, device=DEVICE, generator=g) * 6
    return x, norm, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)


def _row_bytes(dim, quant, fake, normed=False):
    if fake or quant is None:
        out = 2 * dim
    elif quant == "fp8":
        out = dim + dim // 32
    else:
        out = dim // 2 + dim // nr.QUANTS[quant][0]
    return 2 * dim + out + (2 * dim if normed else 0)


def cases(sweep: bool = False) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    kv = _inputs((1, ROWS, DIM), True, g)
    keys = _inputs((1, ROWS, INDEX_DIM), True, g)
    queries = _inputs((1, INDEX_TOKENS, INDEX_HEADS, INDEX_DIM), False, g)
    out = []

    def fwd(name, inputs, quant, normed=False):
        x, norm, cos, sin = inputs
        rows = x.numel() // x.shape[-1]
        out.append({
            "name": f"norm_rope/{name}",
            "fn_triton": lambda: nr.norm_rope_fake_quant(x, cos, sin, **_norm(norm), quant=quant, return_normed=normed,
                                                         impl="triton"),
            "fn_baseline": lambda: _unfused(x, norm, cos, sin, quant),
            "bytes": rows * _row_bytes(x.shape[-1], quant, True, normed)})

    fwd("main_kv_fp4_latent", kv, "fp4", normed=True)  # the compressor site: main KV + pre-RoPE latent
    fwd("swa_kv_fp8", kv, "fp8")
    fwd("kv_no_quant", kv, None)  # QAT off (pre-training): norm + RoPE only
    fwd("index_keys_fp4_ue8m0", keys, "fp4_ue8m0")
    fwd("index_queries_fp4_ue8m0", queries, "fp4_ue8m0")

    x, norm, cos, sin = kv
    rows = x.numel() // DIM
    for quant in ("fp4", "fp8"):
        block, scale_fmt = nr.QUANTS[quant]
        if quant == "fp8":
            base = lambda: fp8.quantize_fp8(apply_rope(norm(x), cos, sin), 32, impl="triton")  # noqa: E731
        else:
            base = lambda b=block, f=scale_fmt: fp4.quantize(  # noqa: E731
                apply_rope(norm(x), cos, sin), b, f, impl="triton")
        out.append({"name": f"norm_rope/record_{quant}",
                    "fn_triton": lambda q=quant: nr.norm_rope_quantize(x, cos, sin, **_norm(norm), quant=q,
                                                                       impl="triton"),
                    "fn_baseline": base, "bytes": rows * _row_bytes(DIM, quant, False)})

    # Backward of the main-KV site: graphs built once, each timed call replays only the backward (dx and dw).
    grads = {}
    for impl in ("triton", "reference"):
        leaf = x.detach().requires_grad_()
        q = nr.norm_rope_fake_quant(leaf, cos, sin, **_norm(norm), quant="fp4", impl=impl)
        grads[impl] = (q, leaf, torch.randn_like(q))

    def backward(impl):
        q, leaf, dq = grads[impl]
        return lambda: torch.autograd.grad(q, (leaf, norm.weight), dq, retain_graph=True)

    out.append({"name": "norm_rope/main_kv_fp4_bwd", "fn_triton": backward("triton"),
                "fn_baseline": backward("reference"), "bytes": rows * (6 * DIM + 4)})

    if sweep:
        rstd = nr._forward(x, norm.weight, cos, sin, norm.eps, "fp4", fake=True, normed=False, rstd=True)[3]
        for rpp, warps in ((2, 4), (8, 4), (16, 4), (8, 8), (16, 8), (32, 8)):
            out.append({"name": f"norm_rope/main_kv_fp4_latent/r{rpp}_w{warps}", "sweep": True,
                        "fn_triton": lambda a=(rpp, warps): nr._forward(
                            x, norm.weight, cos, sin, norm.eps, "fp4", fake=True, normed=True, rstd=False,
                            rows_per_prog=a[0], num_warps=a[1]),
                        "fn_baseline": lambda: None, "bytes": rows * _row_bytes(DIM, "fp4", True, True)})
        for rpp, warps in ((2, 4), (8, 4), (8, 8)):
            out.append({"name": f"norm_rope/main_kv_fp4_bwd_kernel/r{rpp}_w{warps}", "sweep": True,
                        "fn_triton": lambda a=(rpp, warps): nr._backward(
                            grads["triton"][2], x, norm.weight, rstd, cos, sin, need_dw=True, rows_per_prog=a[0],
                            num_warps=a[1]),
                        "fn_baseline": lambda: None, "bytes": rows * (6 * DIM + 4)})
    return out
