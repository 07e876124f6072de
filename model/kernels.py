"""The kernel switch (`ModelConfig.kernels`): the one place that resolves it, and thin calls into `kernels/`.

Contract: "reference" runs the plain-PyTorch code in the model files, "triton" the Triton kernels of `kernels/`
(tensors and numbers only; the module-aware glue is here), "auto" triton on CUDA and reference elsewhere
(`resolve`, `CHOICES`). Both paths compute the same functions (tests/kernels, tests/model/test_kernels_switch.py).
The switch is resolved once per module (`KernelPath`: the attention, the block's mHC step, the Engram) whenever the
module is placed (built, `.to()`, `.to_empty()`); forwards read `kernel_path`, so one forward takes one path
everywhere. Where the Triton path does not apply (DTensor inputs or weights, the dense warm-up, a sharded Engram
table, ...) the site keeps the reference path. The Triton attention path keeps the selection as int32 top-k ids
[B, T, K] and the pool as int32 block ids [B, T, P] (-1 = empty); the reference path keeps [B, T, E] bool masks.
Exact ties in the indexer scores may be broken differently on the two paths (both pick a valid top-k).

Design and reasoning: docs/model.md#kernel-switch
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from kernels import fp4, fp8
from model import mhc
from model.common import autocast_dtype, full_precision
from model.rope import apply_rope

__all__ = [
    "CHOICES",
    "resolve",
    "KernelPath",
    "plain",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "fuses_norm",
    "norm_rope_quant",
    "sparse_attention",
    "index_scores",
    "index_scores_pool",
    "candidate_pool",
    "select_topk",
    "slot_entries",
    "pool_entries",
    "mhc_step",
    "mhc_single_pass",
    "engram_forward",
]

CHOICES = ("reference", "triton", "auto")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(kernels: str, device: torch.device | str) -> str:
    """ModelConfig.kernels and the activations' device -> "triton" or "reference".

    "auto" is triton on CUDA only. "triton" elsewhere needs the Triton CPU interpreter (TRITON_INTERPRET=1, the
    tests' mode) and fails here, by name, without it. The meta device (shape-only runs) always takes the
    reference: no kernel launches there."""
    if kernels not in CHOICES:
        raise ValueError(f"model.kernels must be one of {list(CHOICES)}, got {kernels!r}")
    kind = torch.device(device).type
    if kind == "meta":
        return "reference"
    if kernels == "auto":
        return "triton" if kind == "cuda" else "reference"
    if kernels == "triton" and kind != "cuda" and not _interpreting():
        raise RuntimeError(f"model.kernels='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                           f"interpreter), got tensors on {kind}")
    return kernels


class KernelPath:
    """Mixin (before nn.Module in the bases) for a module with a kernel switch: `kernel_path` ("triton" or
    "reference") is `resolve(self.kernels, device)` for the device of `self._kernel_device()` (a parameter the
    module computes with), set at the end of __init__ (`_resolve_kernel_path`) and again after every `_apply`
    (`.to()`, `.to_empty()`, `.cuda()`), the calls that place a module. A meta-built model resolves to the
    reference and re-resolves when materialised. A module placed where its switch cannot run (kernels="triton" on
    the CPU without the interpreter, e.g. built there before `.cuda()`) raises `resolve`'s error when a forward reads
    `kernel_path`, not when it is built."""

    kernels: str = "reference"  # ModelConfig.kernels
    _kernel_path: str = "reference"
    _kernel_error: str | None = None

    def _kernel_device(self) -> torch.device:
        raise NotImplementedError

    def _resolve_kernel_path(self) -> None:
        try:
            self._kernel_path, self._kernel_error = resolve(self.kernels, self._kernel_device()), None
        except RuntimeError as e:
            self._kernel_path, self._kernel_error = "reference", str(e)

    @property
    def kernel_path(self) -> str:
        if self._kernel_error is not None:
            raise RuntimeError(self._kernel_error)
        return self._kernel_path

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._resolve_kernel_path()
        return out


def plain(*tensors: torch.Tensor | None) -> bool:
    """True when no tensor is a DTensor: the kernels' host wrappers take plain (local) tensors only."""
    return not any(isinstance(t, DTensor) for t in tensors)


# -- QAT fake quantisation ------------------------------------------------------------------------------------------
def fake_quant_fp4(x: torch.Tensor, block: int, scale_fmt: str, path: str) -> torch.Tensor:
    """FP4 E2M1 fake-quant with a straight-through gradient (kernels.fp4.fake_quant), bit-identical both ways."""
    impl = path if plain(x) else "reference"
    return fp4.fake_quant(x.contiguous() if impl == "triton" else x, block=block, scale_fmt=scale_fmt, impl=impl)


def fake_quant_fp8(x: torch.Tensor, block: int, path: str) -> torch.Tensor:
    """FP8 E4M3 fake-quant with a straight-through gradient (kernels.fp8.fake_quant_fp8), bit-identical both ways."""
    impl = path if plain(x) else "reference"
    return fp8.fake_quant_fp8(x.contiguous() if impl == "triton" else x, block=block, impl=impl)


# quant name of a site -> (block, scale format) of its fake-quant (kernels.norm_rope_fp4.QUANTS)
QUANTS = {"fp4": (16, "e4m3"), "fp4_ue8m0": (32, "ue8m0"), "fp8": (32, "ue8m0")}


def fake_quant(x: torch.Tensor, quant: str | None, path: str) -> torch.Tensor:
    """The fake-quant of a site by its quant name (`QUANTS`; None: x unchanged)."""
    if quant is None:
        return x
    if quant == "fp8":
        return fake_quant_fp8(x, QUANTS[quant][0], path)
    return fake_quant_fp4(x, *QUANTS[quant], path)


def fuses_norm(norm, path: str) -> bool:
    """True when `norm_rope_quant` on this path applies `norm` inside its kernel, reading the weight directly: a
    module whose forward ends in `norm` then hands over its pre-norm output (Compressor(norm=False)). False under a
    tensor-parallel plan (a DTensor weight), where only the module's own call may apply it."""
    return path == "triton" and plain(norm.weight)


def norm_rope_quant(x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor, quant: str | None, path: str, *,
                    return_normed: bool = False):
    """fake_quant(apply_rope(norm(x), cos, sin)): the rows of a quantised attention tensor, in x's dtype.

    x [B, T, D] or [B, T, H, D]; norm: a model.common.RMSNorm module, or None for no norm; cos, sin [T, R / 2]
    (the last R channels rotate); quant: "fp4" (e4m3 scale per 16: main KV), "fp4_ue8m0" (ue8m0 per 32: indexer
    q/k), "fp8" (SWA KV) or None (QAT off). Returns q, or (q, y) with return_normed: y = norm(x), pre-RoPE and
    detached (the latent the indexer keys are made of).
    Triton path: one pass, kernels.norm_rope_fp4 (its backward is the quantiser's straight-through gradient, RoPE's
    transpose and the norm's backward), wherever x and the norm's weight are plain tensors and there is a norm or a
    quantiser to fuse. Otherwise the model's three steps: the norm module, `apply_rope`, the fake-quant."""
    weight = None if norm is None else norm.weight
    if path == "triton" and (norm is not None or quant is not None) and plain(x, weight, cos, sin):
        from kernels import norm_rope_fp4  # triton: an optional dependency (none off Linux), the Triton path's only

        return norm_rope_fp4.norm_rope_fake_quant(x.contiguous(), cos, sin, weight=weight,
                                                  eps=None if norm is None else norm.eps, quant=quant,
                                                  return_normed=return_normed, impl="triton")
    y = x if norm is None else norm(x)
    q = fake_quant(apply_rope(y, cos, sin), quant, path)
    return (q, y.detach()) if return_normed else q


# -- attention ----------------------------------------------------------------------------------------------------
def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the reference's einsums compute in: the autocast dtype inside an autocast region, else t's."""
    return autocast_dtype(t.device.type) or t.dtype


def sparse_attention(q: torch.Tensor, kv_win: torch.Tensor, kv_cmp: torch.Tensor | None,
                     topk_idx: torch.Tensor | None, sink: torch.Tensor, window: int, *, topk_probs: bool = False,
                     lead: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.sparse_attention: q [B, T, H, D] over the window of kv_win [B, lead + T, D] and the entries of kv_cmp
    [B, E, D] (None: window only) picked by topk_idx [B, T, K] int32 (-1 = empty); sink [H] fp32. `lead`: rows of
    earlier tokens in front of kv_win (a context-parallel halo), whose queries live on another rank.
    Returns (out [B, T, H, D], probs [B, T, K] fp32 head-summed and detached, or None): `attend`'s output and its
    p_cmp summed over heads at the picked entries.

    Inside an autocast region the reference's einsums run in the autocast dtype (a compressor may hand over fp32
    entries next to bf16 queries), so the operands are cast to it, as autocast would; the kernel needs one dtype."""
    from kernels import sparse_attention as sa  # triton: an optional dependency, needed by the Triton path only

    dtype = _matmul_dtype(q)
    q, kv_win = q.to(dtype).contiguous(), kv_win.to(dtype).contiguous()
    if kv_cmp is None:
        topk_idx = None
    else:
        kv_cmp, topk_idx = kv_cmp.to(dtype).contiguous(), topk_idx.contiguous()
    if lead:  # empty query rows for the halo's tokens: zero queries (no output gradient reaches them), no top-k
        q = torch.cat((q.new_zeros(q.shape[0], lead, *q.shape[2:]), q), dim=1)
        if topk_idx is not None:
            topk_idx = torch.cat((topk_idx.new_full((topk_idx.shape[0], lead, topk_idx.shape[2]), -1), topk_idx), 1)
    out = sa.sparse_attention(q, kv_win, kv_cmp, topk_idx, sink.contiguous(), window,
                              return_topk_probs=topk_probs and kv_cmp is not None, impl="triton")
    out, probs = out if isinstance(out, tuple) else (out, None)
    if lead:
        out, probs = out[:, lead:], None if probs is None else probs[:, lead:]
    return out, probs


# -- indexer ------------------------------------------------------------------------------------------------------
def _indexer():
    """kernels.indexer, imported on the first Triton indexer call."""
    from kernels import indexer  # triton: an optional dependency (none off Linux), needed by the Triton path only

    return indexer


def _same_dtype(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference scores in fp32 (q.float(), k.float()); when q and k differ in dtype (fp32 keys next to bf16
    queries under autocast) the kernel gets both in fp32, an exact upcast. Same dtype: unchanged (the kernel
    accumulates in fp32)."""
    if q.dtype != k.dtype:
        q, k = q.float(), k.float()
    return q.contiguous(), k.contiguous()


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, ratio: int, q_offset: int = 0
                 ) -> torch.Tensor:
    """Indexer scores q [B, T, Hi, Di], w [B, T, Hi] fp32, k [B, E, Di] -> [B, T, E] fp32, -inf where an entry
    is not visible to the query at absolute position q_offset + t. Differentiable in q, w, k."""
    q, k = _same_dtype(q, k)
    return _indexer().index_scores(q, w.contiguous(), k, ratio, q_offset=q_offset, impl="triton")


def index_scores_pool(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, pool: torch.Tensor, ratio: int,
                      block_size: int, q_offset: int = 0) -> torch.Tensor:
    """Reindex scores over the candidate pool [B, T, P] int32 block ids -> slot scores [B, T, S] fp32, slot
    i * BS + j scoring entry pool[..., i] * BS + j (-inf: empty, not visible or past E). Differentiable in q, w, k."""
    q, k = _same_dtype(q, k)
    return _indexer().index_scores_pool(q, w.contiguous(), k, pool, ratio, block_size, q_offset=q_offset,
                                     impl="triton")


def candidate_pool(scores: torch.Tensor, ratio: int, block_size: int, topk_blocks: int, q_offset: int = 0
                   ) -> torch.Tensor:
    """Masked scores [B, T, E] -> the hierarchical candidate pool, [B, T, P] int32 block ids (-1 = empty)."""
    return _indexer().candidate_pool(scores.contiguous(), ratio, block_size, topk_blocks, q_offset=q_offset,
                                  impl="triton")


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores [B, T, X] (-inf = not allowed) -> positions [B, T, min(k, X)] int32 of the top picks along the last
    dim, -1 where a pick is -inf. Positions, not entry ids: the indexer's KL reads its differentiable scores
    through them (slot scores of a pool map to entries with `slot_entries`)."""
    return _indexer().select_topk(scores, k, impl="triton")


def slot_entries(pos: torch.Tensor, pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """Top-k slot positions [B, T, K] of pool slot scores -> entry ids [B, T, K] int32 (-1 stays -1)."""
    taken = pos >= 0
    slot = pos.clamp_min(0).long()
    block = pool.gather(-1, slot // block_size).long()
    return torch.where(taken, block * block_size + slot % block_size, -1).to(torch.int32).contiguous()


def pool_entries(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool block ids [B, T, P] -> the entry of every slot, [B, T, S] int64 (-1 for an empty block; a slot past E
    keeps its id, its score is -inf)."""
    ent = pool.long()[..., None] * block_size + torch.arange(block_size, device=pool.device)
    return torch.where(pool[..., None] >= 0, ent, -1).flatten(-2)


# -- mHC and Engram ------------------------------------------------------------------------------------------------
def mhc_step(impl: str, y, S, coeffs, pre_lag, next_site, path: str):
    """model.mhc.mhc_step on a kernel path: "triton" runs the single-pass step as the fused Triton kernels
    (`mhc_single_pass`); the unfused step has no kernel (asking for it is asking for the literal three passes)."""
    if path == "triton" and impl == "single_pass":
        return mhc_single_pass(y, S, coeffs, pre_lag, next_site)
    return mhc.mhc_step(impl, y, S, coeffs, pre_lag, next_site)


def mhc_single_pass(y, S, coeffs, pre_lag, next_site, *, coeff_kernel: bool = True):
    """model.mhc.single_pass as the fused Triton step (kernels.mhc_triton.mhc_step) and the next site's coefficients
    in one launch each way (kernels.mhc_coeffs_triton.next_coeffs): (S' [B, T, n, D], x [B, T, D], next coeffs or
    None). y [B, T, D], S [B, T, n, D] (any leading dims). The reference when a tensor-parallel plan made the next
    site's parameters (read outside its own call here) or the streams DTensors.

    coeff_kernel=False keeps the coefficients in PyTorch (site.coeffs_from_logits: some 100 small kernels, most of them
    the Sinkhorn iterations); tests and the bench compare the two."""
    from kernels import mhc_coeffs_triton, mhc_triton  # triton: an optional dependency, the Triton path's only

    fn = None if next_site is None else next_site.fn
    if not plain(y, S, fn, *coeffs, pre_lag):
        return mhc.single_pass(y, S, coeffs, pre_lag, next_site)
    *lead, n, D = S.shape
    with full_precision(S.device.type):  # coefficient math stays fp32 (A6), as in the reference
        mix = mhc.mix_matrix(pre_lag, coeffs.post, coeffs.comb)  # [B, T, n+1, n+1]
        mix = mix.expand(*lead, n + 1, n + 1).reshape(-1, n + 1, n + 1)
        s_new, x, sumsq, raw = mhc_triton.mhc_step(y.reshape(-1, D), S.reshape(-1, n, D), mix,
                                                   None if fn is None else fn.float())
        s_new, x = s_new.view(*lead, n, D), x.view(*lead, D)
        if next_site is None:
            return s_new, x, None
        if coeff_kernel:
            pre, post, comb = mhc_coeffs_triton.next_coeffs(
                raw, sumsq, next_site.scale, next_site.base, dim=next_site.dim, norm_eps=next_site.norm_eps,
                eps=next_site.eps, sinkhorn_iters=next_site.sinkhorn_iters)
            return s_new, x, mhc.Coeffs(pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n))
        # The 1/rms factor is linear, so it is applied once to the accumulated projection (as the reference).
        m = raw * torch.rsqrt(sumsq[:, None] / (n * D) + next_site.norm_eps)
        return s_new, x, next_site.coeffs_from_logits(m.view(*lead, -1))


def engram_forward(module, S, row_ids, dead, *, table_grad: str = "dense"):
    """Engram.forward as the Triton gather (kernels.engram_triton.lookup), the module's wkv (a cuBLAS GEMM) and the
    fused gate + update (kernels.engram_triton.gate_update): S [B, T, n, D], row_ids [B, T, C], dead [B, T] bool or
    None -> S' [B, T, n, D]. The caller checks `plain` first: the reference path is the module's own forward.
    table_grad: "dense" (the table's usual gradient) or "sparse" (touched rows only: kernels.engram_triton.lookup)."""
    from kernels import engram_triton  # triton: an optional dependency, needed by the Triton path only

    B, T, n, D = S.shape
    rows = engram_triton.lookup(module.table, row_ids.reshape(B * T, -1), table_grad=table_grad)  # [N, C, Dh]
    kv = module.wkv(rows.flatten(-2).to(module.wkv.weight.dtype))  # [N, (n + 1) * D], cuBLAS
    qk = module.q_weight.float() * module.k_weight.float()  # used only as their product (A8)
    flat_dead = dead.reshape(B * T) if dead is not None else None
    return engram_triton.gate_update(S.reshape(B * T, n, D), kv, qk, flat_dead, module.eps).view(B, T, n, D)
