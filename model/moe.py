"""Mixture of experts (SPEC 1.6, REFERENCE A7): sqrt-softplus router with aux-loss-free bias balancing (one bias for
text tokens, one for image tokens), stacked SwiGLU experts, and a shared expert.

Shape legend: B batch, T tokens per sequence, N = B*T tokens, D model dim, E routed experts, K experts per token, F
expert width, S = N*K token copies (sorted by expert), Fs = num_shared_experts * F.

Contract: `MoE(x, image_mask, experts=None)` -> (y, expert load [2, E], sequence-balance loss or None): router ->
dispatcher.dispatch -> grouped experts -> dispatcher.combine (+ shared expert). `LocalDispatcher` keeps every expert
local; an all-to-all dispatcher with the same three calls replaces it under EP. The balancing biases (`gate.bias`,
`gate.bias_image`) are persistent fp32 buffers, never seen by the optimiser; `add_load` / `update_bias` move them
from the counted loads.

Design and reasoning: docs/model.md#mixture-of-experts
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_gemm import fp8_grouped_linear
from model.common import autocast_dtype, full_precision, init_normal, local
from model.config import MoEConfig
from model.fp8 import maybe_fp8_linear, use_fp8

# Normalisation guard of the routing weights, as in the reference.
_WEIGHT_EPS = 1e-20


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def expert_counts(idx: torch.Tensor, num_bins: int) -> torch.Tensor:
    """idx (any shape, int64 in [0, num_bins)) -> [num_bins] int64 occurrences of each value.

    torch.bincount's output length depends on the data (max(idx) + 1 when it exceeds minlength), which stops
    torch.compile and needs a host sync on CUDA; a scatter-add into a fixed-size vector does neither. Integer sums:
    exact and deterministic."""
    flat = idx.reshape(-1)
    return torch.zeros(num_bins, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


# The grouped GEMM as a custom operator: y [S, out] = x [S, in] @ w[e]^T for the rows of each group e (rows grouped
# by expert; offs [E] int32 the end row of each group, on the device). Its own operator, with its own backward
# (torch._grouped_mm again), because torch._grouped_mm's built-in backward fails on CPU in fp32 (a stride check on
# the weight gradient) and its shape function accepts bf16 only, which stops torch.compile on the CPU path; as a
# custom operator, compiled graphs call it as one opaque node. No host sync anywhere: the group sizes stay on the
# device.


@torch.library.custom_op("cedar::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("cedar::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                            offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad.contiguous()
    grad_x = torch._grouped_mm(grad, w, offs=offs)  # [S, in]
    grad_w = torch._grouped_mm(grad.t(), x, offs=offs)  # [E, out, in]; an empty group's rows are zero
    return grad_x, grad_w


@_grouped_mm_backward_op.register_fake
def _(grad, x, w, offs):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_grad(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad_x, grad_w = _grouped_mm_backward_op(grad, x, w, offs)
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_grad, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, in] grouped by expert, w [E, out, in] (x's dtype), offs [E] int32 cumulative group ends -> [S, out]."""
    return _grouped_mm_op(x, w, offs)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """perm [S] int64, a permutation of 0..S-1 -> its inverse: inverse[perm[i]] = i."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


class _GatherRows(torch.autograd.Function):
    """out = x.index_select(0, perm // copies) for a permutation perm of the S = rows * copies copies of x's rows.

    index_select's own backward scatter-adds the gradient (index_add_): atomics on a GPU, in the gradient's dtype,
    so a bf16 gradient is rounded at every add and the fp32 sum's order varies run to run; the aten bf16 kernel is
    also slow (7 ms of an H100 step of v41_small for the combine's un-permute alone). Since every copy lands once,
    the backward is a gather through the inverse permutation and, for copies > 1, a sum over each row's copies in
    fp32 in a fixed order: deterministic and without atomics."""

    @staticmethod
    def forward(ctx, x, perm, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, perm // copies if copies > 1 else perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        if ctx.copies > 1:
            acc = torch.promote_types(grad.dtype, torch.float32)  # bf16 gradients are summed in fp32
            g = g.view(-1, ctx.copies, g.shape[-1]).sum(1, dtype=acc).to(grad.dtype)
        return g, None, None, None


def gather_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor | None = None,
                copies: int = 1) -> torch.Tensor:
    """x [R, D], perm [R * copies] int64 a permutation of the copies (copy c of row r is c // copies = r), inverse
    its inverse (computed when None) -> x.index_select(0, perm // copies) [R * copies, D], whose gradient is a
    gather (see _GatherRows), not a scatter-add."""
    return _GatherRows.apply(x, perm, inverse_permutation(perm) if inverse is None else inverse, copies)


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(g) * u in fp32, with the reference's clamps: u to [-limit, limit], g capped above at limit.

    limit <= 0 turns the clamps off. The GEMMs that produce g and u run in the model dtype; from their output
    on everything is fp32 (REFERENCE A7), which keeps silu and the clamp thresholds exact in bf16 runs.
    """
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


class Router(nn.Module):
    """scores = sqrt(softplus(x W^T)) in fp32; top-k of (scores + bias) picks experts; the unbiased scores weight.

    The bias only steers selection (aux-loss-free balancing); gradients reach `weight` through the scores of
    the selected experts (and through the optional sequence-wise balance loss).
    """

    def __init__(self, dim: int, num_experts: int, experts_per_token: int, routed_scale: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.topk = experts_per_token
        self.routed_scale = routed_scale
        self.weight = nn.Parameter(torch.empty(num_experts, dim))  # [E, D]
        # fp32 whatever the model dtype: see docs/model.md#mixture-of-experts for why these are buffers.
        self.register_buffer("bias", torch.empty(num_experts, dtype=torch.float32))  # [E], text tokens
        self.register_buffer("bias_image", torch.empty(num_experts, dtype=torch.float32))  # [E], image tokens

    def init_weights(self, init_std: float) -> None:
        with torch.no_grad():
            init_normal(self.weight, init_std)
            self.bias.zero_()
            self.bias_image.zero_()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> scores [N, E] fp32 (gate_temp is 1.0 in the flagship, so there is no temperature)."""
        with full_precision(x.device.type):  # fp32 under a bf16 autocast too, as the reference scores
            logits = F.linear(x.float(), local(self.weight).float())
        # Clamp at the smallest normal fp32: softplus underflows to 0 for logits below about -87, where the
        # sqrt's infinite slope would turn the gradient into NaN. Values above the clamp are untouched.
        return F.softplus(logits).clamp_min(torch.finfo(torch.float32).tiny).sqrt()

    def forward(
        self, x: torch.Tensor, image_mask: torch.Tensor | None = None, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D], image_mask [N] bool or None -> (weights [N, K] fp32, topk_idx [N, K] int64, scores [N, E]).
        experts [N, K] int64: recorded choices to route by instead (RL's routing replay, R3; a row of -1 chooses)."""
        scores = self.scores(x)
        if image_mask is None:
            bias = self.bias
        else:
            bias = torch.where(image_mask[:, None], self.bias_image, self.bias)  # [N, E]
        # The bias is a constant of selection: top-k indices carry no gradient, so detaching is implicit.
        topk_idx = torch.topk(scores + bias, self.topk, dim=-1, sorted=False).indices  # [N, K]
        if experts is not None:
            topk_idx = torch.where((experts >= 0).all(-1, keepdim=True), experts.long(), topk_idx)
        weights = scores.gather(1, topk_idx)  # unbiased scores
        weights = weights / (weights.sum(-1, keepdim=True) + _WEIGHT_EPS) * self.routed_scale
        return weights, topk_idx, scores


class LocalDispatcher:
    """Dropless token dispatch when every expert lives on this rank.

    The interface an all-to-all (expert-parallel) dispatcher must keep:
    - dispatch(x [N, D], topk_idx [N, K], topk_weights [N, K]) ->
      (x_sorted [S', D], weights_sorted [S'], tokens_per_expert [E_local] int64, handle)
      where rows are grouped by local expert in expert order and S' is the number of copies received.
    - combine(y_sorted [S', D], handle, num_tokens N) -> [N, D] fp32, the per-token sum over its K copies.
    The routing weights travel with the tokens (as DeepEP's dispatch does) because the reference multiplies
    them in before w2, on the expert's side. For this dispatcher the handle is `order` [S]: copy s = n*K + k of
    token n goes to row position i where order[i] = s.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = topk_idx.shape[1]
        flat_idx = topk_idx.reshape(-1)  # [S]
        # Stable sort keeps tokens in their original order inside each expert's slice (deterministic runs).
        order = torch.argsort(flat_idx, stable=True)  # [S]
        tokens_per_expert = expert_counts(flat_idx, self.num_experts)  # [E] int64
        x_sorted = gather_rows(x, order, copies=k)  # [S, D], x.index_select(0, order // k)
        weights_sorted = topk_weights.reshape(-1).index_select(0, order)  # [S]
        return x_sorted, weights_sorted, tokens_per_expert, order

    def combine(self, y_sorted: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
        s, d = y_sorted.shape
        # Un-permute, then sum each token's K copies in fp32. Same result as a scatter-add (index_add_), but
        # with a fixed summation order: CUDA's atomic scatter-add would make the fp32 sum nondeterministic.
        inverse = inverse_permutation(order)
        y = gather_rows(y_sorted, inverse, order).view(num_tokens, s // num_tokens, d)  # [N, K, D]
        return y.float().sum(1)


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts stacked along dim 0 (the dim expert parallelism shards).

    w1, w3: [E, F, D] (gate and up projections), w2: [E, D, F] (down projection); the per-expert layout
    matches HF's `experts.{e}.w{1,2,3}.weight`, so conversion is a stack. Under expert parallelism they are
    DTensors sharded on dim 0 (trainer/parallel/expert.py) and forward sees only this rank's E_local experts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, swiglu_limit: float, fp8: bool = False) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        # model.fp8_gemm, decided here: the FP8 grouped GEMMs (kernels.fp8_gemm) where both widths are multiples of
        # 128, else the paths below in the compute dtype
        self.fp8 = use_fp8(fp8, dim, hidden_dim)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        # None: the grouped GEMM (sync-free) on CUDA in bf16 and in compiled graphs where torch._grouped_mm takes the
        # dtype and the row strides; the padded batched GEMM (sync-free too) where a step must not read the device
        # but the grouped GEMM does not apply (a CUDA graph's capture in fp32, a compiled graph of misaligned rows);
        # the per-expert loop elsewhere. "grouped" / "padded" / "loop" force one path (tests compare them).
        self.path: str | None = None

    def init_weights(self, init_std: float) -> None:
        # w2 uses init_std as well: no depth-scaled output init is prescribed (REFERENCE A1 inits at 0.02).
        with torch.no_grad():
            for w in (self.w1, self.w3, self.w2):
                init_normal(w, init_std)

    def _path(self, x: torch.Tensor, dtype: torch.dtype) -> str:
        if self.path is not None:
            return self.path
        if self._grouped_ok(x, dtype):
            return "grouped"
        # compiling first: the capture query is not traceable (a graph break under torch.compile on a GPU)
        capturing = torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())
        return "padded" if capturing else "loop"

    def _grouped_ok(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if not hasattr(torch, "_grouped_mm"):
            return False
        # Both kernels want 16-byte aligned row strides; the CUDA one bf16 only, the CPU one any float dtype.
        f, d = self.w1.shape[1:]
        aligned = (d * dtype.itemsize) % 16 == 0 and (f * dtype.itemsize) % 16 == 0
        if x.is_cuda:
            return aligned and dtype == torch.bfloat16
        # CPU: the loop in eager mode (torch's CPU grouped GEMM is slower than per-expert GEMMs: 24 vs 18 ms forward
        # + backward for 1,024 tokens of v41_tiny's MoE, and a custom operator's call costs more than a decode step's
        # tiny GEMMs); the grouped one inside a compiled graph, which cannot hold the loop's host read.
        return aligned and dtype.is_floating_point and torch.compiler.is_compiling()

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """x [S, D] grouped by expert, weights [S] fp32, tokens_per_expert [E] -> [S, D] in x.dtype.

        E here is the number of experts this rank holds (all of them without expert parallelism). The grouped
        path has no host sync (group ends stay on the device: torch.compile and CUDA graphs see static shapes);
        the per-expert loop reads the group sizes on the host."""
        w1, w3, w2 = (local(w) for w in (self.w1, self.w3, self.w2))  # [E, F, D], [E, F, D], [E, D, F]
        # The GEMMs' dtype: autocast's where it is on (the loop's matmuls get it from autocast itself).
        dtype = autocast_dtype(x.device.type) or x.dtype
        if self.fp8:
            return self._fp8(x.to(dtype), weights, tokens_per_expert, w1, w3, w2)
        path = self._path(x, dtype)
        if path == "padded":
            return self._padded(x, weights, tokens_per_expert, w1, w3, w2)
        if path == "grouped":
            offs = tokens_per_expert.cumsum(0).to(torch.int32)  # [E], end row of each group
            xc = x.to(dtype)
            g = grouped_mm(xc, w1.to(dtype), offs)  # [S, F]
            u = grouped_mm(xc, w3.to(dtype), offs)
            # Routing weight multiplied in fp32 before w2, then back to the GEMM dtype (REFERENCE A7).
            a = (clamped_swiglu(g, u, self.swiglu_limit) * weights[:, None]).to(dtype)
            return grouped_mm(a, w2.to(dtype), offs)  # [S, D]
        outs = []
        start = 0
        for e, n in enumerate(tokens_per_expert.tolist()):  # host sync: fine for the reference path
            if n == 0:
                continue
            xe, we = x[start:start + n], weights[start:start + n]
            a = clamped_swiglu(xe @ w1[e].T, xe @ w3[e].T, self.swiglu_limit) * we[:, None]
            outs.append(a.to(x.dtype) @ w2[e].T)
            start += n
        if not outs:
            # No rows (S = 0). The empty result stays in the autograd graph of x and weights: under expert
            # parallelism the backward all-to-all behind them must run here too, because the peers run theirs.
            return (x * weights[:, None]).to(x.dtype)
        return torch.cat(outs)

    def _fp8(self, x, weights, tokens_per_expert, w1, w3, w2) -> torch.Tensor:
        """The grouped path with FP8 GEMMs (no host sync: the group ends stay on the device); the weights are quantised
        from their own dtype, the activation in between as the bf16 path rounds it."""
        ends = tokens_per_expert.cumsum(0).to(torch.int32)  # [E], end row of each group
        g = fp8_grouped_linear(x, w1, ends)  # [S, F]
        u = fp8_grouped_linear(x, w3, ends)
        a = (clamped_swiglu(g, u, self.swiglu_limit) * weights[:, None]).to(x.dtype)
        return fp8_grouped_linear(a, w2, ends)  # [S, D]

    def _padded(self, x, weights, tokens_per_expert, w1, w3, w2) -> torch.Tensor:
        """The experts without a host read and without the grouped GEMM: expert e's rows in slab e of an [E, S, D]
        buffer (row r at slot r - start of its group), one batched GEMM per projection, the rows gathered back. It
        reads each expert's weights once and computes E times the rows' FLOPs: for a decode step (S = batch x k
        rows) in a CUDA graph where the grouped GEMM does not take the dtype, not for training."""
        S, E = x.shape[0], tokens_per_expert.shape[0]
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), tokens_per_expert, output_size=S)
        slot = torch.arange(S, device=x.device) - (tokens_per_expert.cumsum(0) - tokens_per_expert)[expert]

        def slab(rows: torch.Tensor) -> torch.Tensor:
            out = rows.new_zeros(E, S, rows.shape[-1])
            out[expert, slot] = rows
            return out

        xs = slab(x)
        a = clamped_swiglu(xs @ w1.transpose(1, 2), xs @ w3.transpose(1, 2), self.swiglu_limit)[expert, slot]
        a = (a * weights[:, None]).to(x.dtype)
        return (slab(a) @ w2.transpose(1, 2))[expert, slot]


class SharedExpert(nn.Module):
    """num_shared_experts always-on experts fused into one SwiGLU MLP of width Fs = num_shared * F.

    Exact: SwiGLU is elementwise in the hidden dim, so summing n experts equals one MLP whose w1/w3 stack their
    rows and whose w2 stacks their columns. nn.Linear submodules so tensor-parallel plans (colwise w1/w3,
    rowwise w2) apply by module path; names match HF's `shared_experts.w{1,2,3}.weight`.
    """

    def __init__(self, dim: int, hidden_dim: int, swiglu_limit: float, fp8: bool = False) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = maybe_fp8_linear(dim, hidden_dim, fp8)  # Fp8Linear under model.fp8_gemm (an nn.Linear too)
        self.w3 = maybe_fp8_linear(dim, hidden_dim, fp8)
        self.w2 = maybe_fp8_linear(hidden_dim, dim, fp8)

    def init_weights(self, init_std: float) -> None:
        with torch.no_grad():
            for lin in (self.w1, self.w3, self.w2):
                init_normal(lin.weight, init_std)  # split under tensor parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D] in x.dtype (no routing weight: the shared expert always weighs 1)."""
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit).to(x.dtype))


class MoE(nn.Module):
    """Routed experts + shared expert; forward(x [B, T, D], image_mask [B, T] | None) -> (y [B, T, D], load [2, E]
    int64 tokens routed to each expert (text row, image row), the sequence-wise balance loss or None when
    seq_aux_loss_coef is 0).

    A forward has no side effect: the loop that runs the blocks (model.forward.forward_blocks) keeps the load
    and the loss in its ForwardState, and the caller that trains adds the loads to the balancing counters
    `load_text` / `load_image` (`add_load`, read by `update_bias`). A recomputation under activation checkpointing
    calls the forward again and drops its result, so nothing is counted twice.
    """

    def __init__(self, dim: int, cfg: MoEConfig, init_std: float, fp8_gemm: bool = False) -> None:
        """fp8_gemm: model.fp8_gemm, FP8 GEMMs for the routed and shared experts (model.fp8)."""
        super().__init__()
        self.cfg = cfg
        self.init_std = init_std
        self.num_experts = cfg.num_experts
        self.chosen_experts: torch.Tensor | None = None  # the last forward's choices, with return_experts
        self.topk = cfg.experts_per_token
        self.gate = Router(dim, cfg.num_experts, cfg.experts_per_token, cfg.routed_scale)
        self.experts = GroupedExperts(dim, cfg.expert_dim, cfg.num_experts, cfg.swiglu_limit, fp8_gemm)
        self.shared_experts = (
            SharedExpert(dim, cfg.num_shared_experts * cfg.expert_dim, cfg.swiglu_limit, fp8_gemm)
            if cfg.num_shared_experts > 0 else None
        )
        # A plain object, not a module: swapping in an all-to-all dispatcher leaves the state dict unchanged.
        self.dispatcher = LocalDispatcher(cfg.num_experts)
        # Tokens routed to each expert since the last update_bias (each of a token's K picks counts once).
        self.register_buffer("load_text", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("load_image", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        # The mean of a per-sequence statistic over the chunks of the sequence, no gradient: the identity when one
        # process holds whole sequences; context parallelism (trainer/parallel/context.py) installs its own.
        self.chunk_mean = _same

    def init_weights(self) -> None:
        self.gate.init_weights(self.init_std)
        self.experts.init_weights(self.init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(self.init_std)
        self.load_text.zero_()  # to_empty() leaves non-persistent buffers uninitialised too
        self.load_image.zero_()

    # --- the three overridable steps -------------------------------------------------------------------

    def dispatch(self, x_flat: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        return self.dispatcher.dispatch(x_flat, topk_idx, topk_weights)

    def experts_forward(
        self, x_sorted: torch.Tensor, weights_sorted: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        return self.experts(x_sorted, weights_sorted, tokens_per_expert)

    def combine(self, y_sorted: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return self.dispatcher.combine(y_sorted, order, num_tokens)

    # --- forward --------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None, experts: torch.Tensor | None = None,
                *, return_experts: bool = False):
        """experts [B, T, K]: recorded routing to replay (a row of -1 routes freely); return_experts: keep the chosen
        experts [B, T, K] (a rollout's record) in `self.chosen_experts`. The outputs are always (y, load, balance):
        the tensor-parallel plan's output hook (trainer/parallel/tensor.py) knows three."""
        b, t, d = x.shape
        x_flat = x.reshape(b * t, d)  # [N, D]
        img = None if image_mask is None else image_mask.reshape(b * t).to(torch.bool)
        forced = None if experts is None else experts.reshape(b * t, -1)
        weights, topk_idx, scores = self.gate(x_flat, img, forced)  # [N, K], [N, K], [N, E]
        balance = self.sequence_balance_loss(scores, topk_idx, b, t) if self.cfg.seq_aux_loss_coef > 0 else None
        load = self.count_load(topk_idx, img)
        x_sorted, w_sorted, tokens_per_expert, order = self.dispatch(x_flat, topk_idx, weights)
        y_sorted = self.experts_forward(x_sorted, w_sorted, tokens_per_expert)  # [S, D]
        out = self.combine(y_sorted, order, b * t)  # [N, D] fp32
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat).float()
        y = out.to(x.dtype).view(b, t, d)
        # set only when asked: torch.compile breaks a checkpointed block's graph at a module attribute's assignment
        # (v41_proxy's compiled step on an H100 under activation checkpointing: 3 breaks, here)
        if return_experts:
            self.chosen_experts = topk_idx.view(b, t, -1)
        return y, load, balance

    # --- balancing ------------------------------------------------------------------------------------

    @torch.no_grad()
    def count_load(self, topk_idx: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        """topk_idx [N, K], image_mask [N] bool or None -> [2, E] int64 picks per expert (text row, image row)."""
        e = self.num_experts
        if image_mask is None:
            text = expert_counts(topk_idx, e)
            return torch.stack([text, torch.zeros_like(text)])
        text_idx = topk_idx.masked_fill(image_mask[:, None], e)  # image tokens land in an overflow bin
        image_idx = topk_idx.masked_fill(~image_mask[:, None], e)
        return torch.stack([expert_counts(text_idx, e + 1)[:e], expert_counts(image_idx, e + 1)[:e]])

    @torch.no_grad()
    def add_load(self, load: torch.Tensor) -> None:
        """Add a forward's [2, E] loads (its output) to the counters `update_bias` reads."""
        self.load_text += load[0]
        self.load_image += load[1]

    def load_counts(self) -> torch.Tensor:
        """[2, E] int64 (row 0 text, row 1 image): a copy a distributed trainer all-reduces (sum) and hands to
        update_bias(counts=...)."""
        return torch.stack([self.load_text, self.load_image])

    @torch.no_grad()
    def update_bias(self, rate: float | None = None, counts: torch.Tensor | None = None) -> None:
        """bias += rate * sign(mean(load) - load) per modality (DeepSeek-V3), then reset the load counters.

        counts: [2, E] from load_counts(), summed over ranks; default the local counters. A modality that saw no
        tokens gets no update (every sign is 0). The plain sign update lets the bias mean drift; that is
        harmless because adding one constant to every expert's bias changes no token's top-k.
        """
        rate = self.cfg.bias_update_rate if rate is None else rate
        counts = self.load_counts() if counts is None else counts
        for bias, load in ((self.gate.bias, counts[0]), (self.gate.bias_image, counts[1])):
            load = load.to(torch.float32)
            bias += rate * torch.sign(load.mean() - load)
        self.load_text.zero_()
        self.load_image.zero_()

    def imbalance(self, counts: torch.Tensor | None = None) -> float:
        """max / mean expert load over text and image tokens together (1.0 = perfect); nan before any token.

        Call before update_bias, which resets the counters.
        """
        counts = self.load_counts() if counts is None else counts
        load = counts.sum(0).to(torch.float32)  # [E]
        return (load.max() / load.mean()).item()

    def sequence_balance_loss(
        self, scores: torch.Tensor, topk_idx: torch.Tensor, batch: int, seq_len: int
    ) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the B sequences.

        Per sequence: f_i = E / (K*T) * #tokens picking expert i, P_i = mean over tokens of s_i / sum_j s_j;
        loss = coef * sum_i f_i * P_i. Gradient reaches the router through P only (f is a count).
        Under context parallelism f is the whole sequence's (the chunks' mean) and P this chunk's: the loss is linear
        in P, so the mean over chunks of this loss is the whole sequence's loss.
        scores [N, E] fp32, topk_idx [N, K] -> scalar fp32.
        """
        e, k = self.num_experts, self.topk
        probs = scores / scores.sum(-1, keepdim=True)  # [N, E]
        p = probs.view(batch, seq_len, e).mean(1)  # [B, E]
        picks = torch.zeros(batch, e, dtype=torch.float32, device=scores.device)
        picks.scatter_add_(1, topk_idx.view(batch, seq_len * k),
                           torch.ones(batch, seq_len * k, dtype=torch.float32, device=scores.device))
        f = self.chunk_mean(picks * (e / (k * seq_len)))  # [B, E]
        return self.cfg.seq_aux_loss_coef * (f * p).sum(-1).mean()
