"""FP8 training GEMMs as DeepSeek-V3 trains them: the plain-PyTorch reference, the autograd, and the dispatch to the
Triton kernels (kernels.fp8_gemm_triton).

Contract: `fp8_linear(x [..., K], w [N, K])`, `fp8_grouped_linear(x [S, K], w [E, N, K], group_ends [E])` (rows
sorted by expert) and `fp8_blockdiag_linear(x [..., G*K], w [G, N, K])` (a block-diagonal weight) return y in x's
dtype. Forward y = x W^T with x quantised to float8_e4m3fn in 1 x 128 blocks (per token, per 128 channels) and W in
128 x 128 blocks, fp32 accumulation; backward dgrad = dy W with dy quantised 1 x 128 and W's 128 x 128 blocks
transposed; wgrad = dy^T x unquantised in x's dtype (bf16 in training; docs say why). Scales are powers of two
(e8m0), the rule of `kernels.fp8.quantize_fp8`: 2^ceil(log2(max(amax, 1e-4) / 448)). K and N must be multiples of
128 (ValueError otherwise). impl: "reference" (dequantise, then matmul in fp32), "triton" (CUDA or the CPU
interpreter), "auto" (triton on CUDA, the reference elsewhere).

Design and reasoning: docs/kernels.md#fp8-training-gemms
"""

from __future__ import annotations

import torch

from kernels.fp8 import pow2_ceil, quantize_fp8
from kernels.quant_common import FP8_AMAX_FLOOR, FP8_MAX

__all__ = ["BLOCK", "fp8_ok", "quantize_weight_fp8", "fp8_gemm", "fp8_linear", "fp8_grouped_linear",
           "fp8_blockdiag_linear"]

BLOCK = 128
"""the scale block: 1 x 128 for activations and gradients, 128 x 128 for weights"""

_IMPLS = ("auto", "reference", "triton")


def _triton():
    """kernels.fp8_gemm_triton, imported on the first impl="triton" call."""
    from kernels import fp8_gemm_triton  # triton is an optional dependency (none off Linux): the reference runs without

    return fp8_gemm_triton


def fp8_ok(*dims: int) -> bool:
    """True when every dim is a multiple of the 128 block (the GEMM's K and N)."""
    return all(d % BLOCK == 0 for d in dims)


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"fp8 GEMM: impl must be one of {list(_IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return impl


def _check_dims(k: int, n: int, fn_name: str) -> None:
    if not fp8_ok(k, n):
        raise ValueError(f"{fn_name}: FP8 GEMMs need in and out dims that are multiples of {BLOCK} "
                         f"(1 x {BLOCK} / {BLOCK} x {BLOCK} scale blocks), got in {k}, out {n}")


def quantize_weight_fp8(w: torch.Tensor, *, impl: str = "reference") -> tuple[torch.Tensor, torch.Tensor]:
    """w [G, N, K] -> (values e4m3 [G, N, K], scales e8m0 [G, N/128, K/128]): one power-of-two scale per 128 x 128
    block, the rounding of kernels.fp8.quantize_fp8."""
    if _resolve(impl, w.device) == "triton":
        return _triton().quantize_weight_fp8(w)
    g, n, k = w.shape
    _check_dims(k, n, "quantize_weight_fp8")
    blocks = w.detach().float().view(g, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True)  # [G, NB, 1, KB, 1]
    inv_max = torch.full((), 1.0 / FP8_MAX, dtype=torch.float32, device=w.device)
    scale_f32, scale_e8m0 = pow2_ceil(amax.clamp_min(FP8_AMAX_FLOOR) * inv_max)
    values = (blocks / scale_f32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(g, n, k), scale_e8m0.view(g, n // BLOCK, k // BLOCK)


def _dequant_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K], e8m0 [M, K/128] -> fp32 [M, K]."""
    return (values.float().unflatten(-1, (-1, BLOCK)) * scales.float()[..., None]).flatten(-2)


def _dequant_weight(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [G, N, K], e8m0 [G, N/128, K/128] -> fp32 [G, N, K]."""
    s = scales.float().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    return values.float() * s


def fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, *,
             group_ends: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             impl: str = "reference") -> torch.Tensor:
    """Block-scaled C = A B^T (kernels.fp8_gemm_triton.fp8_gemm's contract); the reference dequantises both and
    multiplies in fp32. group_ends None: block-diagonal over B's G groups; else rows grouped."""
    if _resolve(impl, a.device) == "triton":
        return _triton().fp8_gemm(a, a_scales, b, b_scales, group_ends=group_ends, out_dtype=out_dtype)
    a32, b32 = _dequant_rows(a, a_scales), _dequant_weight(b, b_scales)
    if group_ends is None:
        out = torch.einsum("mgk,gnk->mgn", a32.unflatten(-1, (b.shape[0], -1)), b32).flatten(1)
        return out.to(out_dtype)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(group_ends.tolist()):  # host sync: fine for the reference
        out[start:end] = a32[start:end] @ b32[e].T
        start = end
    return out.to(out_dtype)


def _gemm_q(x: torch.Tensor, w_values: torch.Tensor, w_scales: torch.Tensor, group_ends, impl: str) -> torch.Tensor:
    """x [M, *] in the compute dtype -> quantise 1 x 128, C = x W^T in x's dtype."""
    xq, xs = quantize_fp8(x.contiguous(), BLOCK, impl=impl)
    return fp8_gemm(xq, xs, w_values, w_scales, group_ends=group_ends, out_dtype=x.dtype, impl=impl)


def _forward(x: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor | None, impl: str) -> torch.Tensor:
    # from the weight's own dtype (the fp32 master under autocast): one rounding, to e4m3
    wq, ws = quantize_weight_fp8(w.contiguous(), impl=impl)
    return _gemm_q(x, wq, ws, group_ends, impl)


def _wgrad(grad: torch.Tensor, x: torch.Tensor, group_ends: torch.Tensor | None, num_groups: int) -> torch.Tensor:
    """dW = dy^T x in the compute dtype (fp32 accumulation inside the matmul), [G, N, K]."""
    if group_ends is None:  # block-diagonal: group g pairs dy's columns g*N .. with x's columns g*K ..
        dy = grad.unflatten(-1, (num_groups, -1)).transpose(0, 1)  # [G, M, N]
        xs = x.unflatten(-1, (num_groups, -1)).transpose(0, 1)  # [G, M, K]
        return torch.bmm(dy.transpose(1, 2), xs)
    if grad.is_cuda and grad.dtype == torch.bfloat16:
        return torch._grouped_mm(grad.t(), x, offs=group_ends)  # an empty group's rows are zero
    out = grad.new_zeros(num_groups, grad.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(group_ends.tolist()):  # host sync: the CPU path
        out[e] = grad[start:end].T @ x[start:end]
        start = end
    return out


# Custom operators, so that compiled graphs call the quantisers and kernels as one opaque node each way (as
# model.moe's grouped GEMM does); the weight is quantised again in backward rather than saved (1 byte an element more
# of activation memory otherwise; the result is the same bits).


@torch.library.custom_op("cedar::fp8_gemm", mutates_args=())
def _fp8_gemm_op(x: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor | None, impl: str) -> torch.Tensor:
    return _forward(x, w, group_ends, impl)


@_fp8_gemm_op.register_fake
def _(x, w, group_ends, impl):
    g, n, _ = w.shape
    return x.new_empty(x.shape[0], n if group_ends is not None else g * n)


@torch.library.custom_op("cedar::fp8_gemm_backward", mutates_args=())
def _fp8_gemm_backward_op(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor | None,
                          impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad.contiguous()
    wq, ws = quantize_weight_fp8(w.contiguous(), impl=impl)
    # dgrad = dy W: W^T's 128 x 128 blocks are W's, transposed (values and scales alike)
    wq_t, ws_t = wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous()
    grad_x = _gemm_q(grad.to(x.dtype), wq_t, ws_t, group_ends, impl)
    grad_w = _wgrad(grad.to(x.dtype), x, group_ends, w.shape[0]).to(w.dtype)
    return grad_x, grad_w


@_fp8_gemm_backward_op.register_fake
def _(grad, x, w, group_ends, impl):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output) -> None:
    x, w, group_ends, impl = inputs
    ctx.save_for_backward(x, w, group_ends)
    ctx.impl = impl


def _grad(ctx, grad):
    x, w, group_ends = ctx.saved_tensors
    grad_x, grad_w = _fp8_gemm_backward_op(grad, x, w, group_ends, ctx.impl)
    return grad_x, grad_w, None, None


_fp8_gemm_op.register_autograd(_grad, setup_context=_setup)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """x [..., K], w [N, K] -> y [..., N] in x's dtype (FP8 forward and dgrad, wgrad in x's dtype)."""
    return fp8_blockdiag_linear(x, w.unsqueeze(0), impl=impl)


def fp8_blockdiag_linear(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """x [..., G*K], w [G, N, K] -> y [..., G*N]: group g of y is x's group g times w[g]^T."""
    g, n, k = w.shape
    _check_dims(k, n, "fp8_linear")
    if x.shape[-1] != g * k:
        raise ValueError(f"fp8_linear: x's last dim {x.shape[-1]} does not match the weight's {g} x {k}")
    y = _fp8_gemm_op(x.reshape(-1, x.shape[-1]), w, None, _resolve(impl, x.device))
    return y.view(*x.shape[:-1], g * n)


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor, *,
                       impl: str = "auto") -> torch.Tensor:
    """x [S, K] sorted by group, w [E, N, K], group_ends [E] int32 cumulative row ends (the last = S) -> [S, N]:
    the rows of group e times w[e]^T. No host sync on the Triton path."""
    e, n, k = w.shape
    _check_dims(k, n, "fp8_grouped_linear")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_grouped_linear: x must be [S, {k}], got {tuple(x.shape)}")
    return _fp8_gemm_op(x, w, group_ends.to(torch.int32), _resolve(impl, x.device))
