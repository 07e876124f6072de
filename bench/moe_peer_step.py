"""A MoE peer for the training step's MFU: a plain MoE decoder in PyTorch with a Cedar model's expert shapes, at its
training FLOPs per token, built the way torchtitan builds its MoE models and timed as bench/peer_step.py times the
dense peer (issue 41).

    python bench/moe_peer_step.py [--match v41_small] [--layers 0] [--experts auto] [--score-func sigmoid]
                                  [--batch-size 4] [--seq-len 2048] [--steps 10] [--warmup 3] [--no-compile]
                                  [--device cuda] [--json OUT.jsonl]

The model: token embedding; `layers` pre-norm blocks (RMSNorm, bench/peer_step.py's attention: fused q/k/v, rotary
embedding, causal `scaled_dot_product_attention`, flash on a GPU; RMSNorm, MoE FFN); a final RMSNorm and an untied
head. The MoE FFN as torchtitan's `models/moe`: a linear router, softmax or sigmoid scores in fp32 (sigmoid's top-k
weights renormalised), top-k of the scores plus an aux-loss-free balancing bias (`update_expert_bias` after each
step, at the matched model's rate), the routed copies sorted by expert, the E routed SwiGLU experts as stacked
weights w1, w3 [E, F, D] and w2 [E, D, F] applied by grouped GEMMs (`torch._grouped_mm`) over the sorted rows (or,
`--experts loop`, one expert at a time with a host sync for the group sizes), un-sorted and weighted by their
scores, plus a shared SwiGLU expert of width num_shared_experts x F. From the matched config (conf/model/<match>.yaml):
E, K, F, the shared experts, dim, heads (head dim = dim / heads), the vocabulary and the routed scale. fp32
parameters under bf16 autocast, each block through `torch.compile` (regional), fused AdamW, plain cross-entropy.
Group sizes are not padded (torchtitan pads them to multiples of 8 for its kernels; `torch._grouped_mm` takes any).

`torch._grouped_mm` (PyTorch 2.11 on CUDA, 2.13 on CPU): a CUTLASS kernel for bf16 on sm90 / sm100, without a host
sync; other dtypes and GPUs run ATen's fallback (one GEMM per group after copying the offsets to the host); the CPU
runs the fallback in fp32 and bf16. Its shape function accepts bf16 only, so a compiled block needs bf16 inputs: the
experts cast to the autocast dtype, as torchtitan casts to bf16. `--experts auto` takes the grouped GEMMs on CPU and
on sm90 / sm100 GPUs where dim and the expert width are multiples of 8 (its operands' rows must be multiples of
16 bytes), the loop elsewhere.

Shape legend: B batch, T tokens per sequence, N = B*T tokens, D model dim, E routed experts, K experts per token,
F expert width, S = N*K routed copies (sorted by expert).

`--layers 0` picks the depth whose training FLOPs per token come closest to the matched model's (model/accounting.py
at `--seq-len`), as bench/peer_step.py does. This model's FLOPs per token: 6 x its active matmul parameters (router,
attention, shared expert, the routed experts x K / E, the head; not the embedding) + 6 x layers x seq_len x dim
(causal attention over half the positions on average, forward and backward).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer_step import (Attention, add_step_args, check_step_args, fail, lm_step, match_config, match_flops,  # noqa: E402
                       report, rope_tables, time_steps)

ExpertsPath = Literal["grouped", "loop"]


def grouped_mm_fast(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs here without a per-group loop: the CPU (whose loop is no slower than ours)
    and CUDA sm90 / sm100, where bf16 takes the CUTLASS kernel."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10))


def grouped_mm_fits(dim: int, expert_dim: int) -> bool:
    """Whether `torch._grouped_mm` takes the experts' bf16 operands: every row a multiple of 16 bytes."""
    return dim % 8 == 0 and expert_dim % 8 == 0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype of x's device when autocast is on, else x's dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def experts_grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """x [S, D] sorted by expert, counts [E] rows per expert, w1 / w3 [E, F, D], w2 [E, D, F] -> [S, D]: three
    grouped GEMMs over the groups, no host sync."""
    dt = compute_dtype(x)
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end row of each group
    x = x.to(dt)
    h = F.silu(torch._grouped_mm(x, w1.to(dt).transpose(-2, -1), offs=offs))  # [S, F]
    h = h * torch._grouped_mm(x, w3.to(dt).transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.to(dt).transpose(-2, -1), offs=offs)


# The group sizes go to the host (a sync), which breaks a compiled graph, and change every step, which would
# recompile what follows the break at every step: the loop stays out of the compiled region.
@torch.compiler.disable
def experts_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """experts_grouped one expert at a time (torchtitan's for-loop path): the same result."""
    dt = compute_dtype(x)
    out = []
    for e, rows in enumerate(x.to(dt).split(counts.tolist())):  # rows [S_e, D]
        h = F.silu(rows @ w1[e].to(dt).t()) * (rows @ w3[e].to(dt).t())
        out.append(h @ w2[e].to(dt).t())
    return torch.cat(out)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Token-choice top-K routing over E stacked SwiGLU experts plus a shared expert: x [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, num_experts: int, experts_per_token: int, expert_dim: int, num_shared: int,
                 score_func: Literal["softmax", "sigmoid"], route_scale: float, experts: ExpertsPath):
        super().__init__()
        self.num_experts, self.topk = num_experts, experts_per_token
        self.score_func, self.route_scale = score_func, route_scale
        self.run_experts = experts_grouped if experts == "grouped" else experts_loop
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, expert_dim))
        self.shared = SwiGLU(dim, num_shared * expert_dim) if num_shared else None
        # aux-loss-free balancing: the bias steers the choice only; the counts feed update_expert_bias
        self.register_buffer("expert_bias", torch.empty(num_experts))
        self.register_buffer("tokens_per_expert", torch.empty(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        x = x.reshape(-1, D)  # [N, D]
        logits = self.gate(x).float()  # [N, E]; the scores in fp32, as torchtitan
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(-1)
        idx = torch.topk(scores + self.expert_bias, self.topk, dim=-1).indices  # [N, K]
        weights = scores.gather(1, idx)  # [N, K]
        if self.score_func == "sigmoid":
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        flat = idx.reshape(-1)  # [S]
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # [E]; a scatter-add, not bincount: fixed size, no host sync
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = flat.argsort(stable=True)  # [S]: copy order[i] of the N*K goes to sorted row i
        routed = self.run_experts(x[order // self.topk], counts, self.w1, self.w3, self.w2)  # [S, D]
        unsorted = routed.new_zeros(routed.shape)
        unsorted[order] = routed  # [S, D] back in token order, K copies per token
        out = torch.bmm(weights[:, None], unsorted.view(-1, self.topk, D).float())[:, 0]  # [N, D] fp32
        if self.shared is not None:
            out = out + self.shared(x)
        return out.to(x.dtype).view(B, T, D)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: MoE):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.moe = moe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


class MoELM(nn.Module):
    """The MoE decoder LM: ids [B, T] -> logits [B, T, vocab] fp32. Build on meta, `to_empty`, `init_weights`."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, *, num_experts: int,
                 experts_per_token: int, expert_dim: int, num_shared: int, route_scale: float = 1.0,
                 score_func: Literal["softmax", "sigmoid"] = "sigmoid", experts: ExpertsPath = "grouped"):
        super().__init__()
        self.heads, self.seq_len = heads, seq_len
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, MoE(dim, num_experts, experts_per_token, expert_dim, num_shared, score_func,
                                  route_scale, experts)) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("cos", torch.empty(seq_len, dim // heads // 2), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, dim // heads // 2), persistent=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=std) if p.dim() > 1 else nn.init.ones_(p)  # 1-D: the norms' weights
        for moe in self.moe_layers():
            moe.expert_bias.zero_()
            moe.tokens_per_expert.zero_()
        cos, sin = rope_tables(self.head.weight.shape[1] // self.heads, self.seq_len)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x)).float()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, read off the parameters (see the module docstring)."""
        matmul = 0.0
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("embed"):
                matmul += p.numel()
        for moe in self.moe_layers():
            matmul += sum(w.numel() for w in (moe.w1, moe.w3, moe.w2)) * moe.topk / moe.num_experts
        dim = self.head.weight.shape[1]
        return 6.0 * matmul + 6.0 * len(self.blocks) * seq_len * dim


@torch.no_grad()
def update_expert_bias(model: MoELM, rate: float) -> None:
    """Aux-loss-free balancing after a step: each expert's bias moves by `rate` towards the mean load (up when
    under-loaded); the counts restart."""
    for moe in model.moe_layers():
        counts = moe.tokens_per_expert
        moe.expert_bias.add_(rate * torch.sign(counts.mean() - counts))
        counts.zero_()


def moe_peer_flops(vocab: int, dim: int, layers: int, seq_len: int, num_experts: int, experts_per_token: int,
                   expert_dim: int, num_shared: int) -> float:
    """MoELM.flops_per_token without building it."""
    per_layer = 4 * dim * dim + num_experts * dim + 3 * dim * expert_dim * (num_shared + experts_per_token)
    return 6.0 * (layers * per_layer + vocab * dim) + 6.0 * layers * seq_len * dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(p)
    p.add_argument("--experts", choices=("auto", "grouped", "loop"), default="auto",
                   help="the routed experts: grouped GEMMs, a per-expert loop, or auto (grouped where fast)")
    p.add_argument("--score-func", choices=("sigmoid", "softmax"), default="sigmoid")
    args = p.parse_args()
    check_step_args(args)
    device = torch.device(args.device)
    cfg = match_config(args.match)
    m, heads = cfg.moe, cfg.attention.num_heads
    if cfg.dim % heads or (cfg.dim // heads) % 2:
        fail(f"--match {args.match}: dim {cfg.dim} over {heads} heads is not an even head dim")
    fits = grouped_mm_fits(cfg.dim, m.expert_dim)
    if args.experts == "grouped" and not (hasattr(torch, "_grouped_mm") and fits):
        fail(f"--experts grouped: torch {torch.__version__} has no torch._grouped_mm, or dim {cfg.dim} / expert "
             f"width {m.expert_dim} are not multiples of 8 (16-byte bf16 rows)")
    experts = args.experts if args.experts != "auto" else "grouped" if grouped_mm_fast(device) and fits else "loop"
    shapes = dict(num_experts=m.num_experts, experts_per_token=m.experts_per_token, expert_dim=m.expert_dim,
                  num_shared=m.num_shared_experts)
    target = match_flops(cfg, args.seq_len)
    layers = args.layers or min(range(1, 200), key=lambda n: abs(
        moe_peer_flops(cfg.vocab_size, cfg.dim, n, args.seq_len, **shapes) - target))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MoELM(cfg.vocab_size, cfg.dim, layers, heads, args.seq_len, route_scale=m.routed_scale,
                      score_func=args.score_func, experts=experts, **shapes)
    model.to_empty(device=device)
    model.init_weights()
    if not args.no_compile:
        for block in model.blocks:
            block.compile()
    step = lm_step(model, cfg.vocab_size, args, device, after=lambda: update_expert_bias(model, m.bias_update_rate))
    timing = time_steps(step, args, device.type == "cuda")
    params = sum(p.numel() for p in model.parameters())
    active = model.flops_per_token(0) / 6 + model.embed.weight.numel()
    report(f"MoE peer of {args.match}: dim {cfg.dim}, {layers} layers, {heads} heads, {m.num_experts} experts "
           f"(top-{m.experts_per_token}, width {m.expert_dim}, {m.num_shared_experts} shared, {experts}, "
           f"{args.score_func}), vocab {cfg.vocab_size} ({params / 1e6:.0f}M parameters, {active / 1e6:.0f}M active)",
           f"MoE peer of {args.match}",
           {"dim": cfg.dim, "layers": layers, "heads": heads, "ffn": m.expert_dim, "vocab": cfg.vocab_size,
            "num_experts": m.num_experts, "experts_per_token": m.experts_per_token,
            "num_shared_experts": m.num_shared_experts, "experts": experts, "score_func": args.score_func},
           model, model.flops_per_token(args.seq_len), target, timing, args, device)


if __name__ == "__main__":
    main()
