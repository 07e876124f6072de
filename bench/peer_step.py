"""A peer for the training step's MFU: a plain dense decoder in PyTorch, at the training FLOPs per token of a Cedar
model, timed the way bench/profile_step.py times Cedar's step (issue 21).

    python bench/peer_step.py [--match v41_small] [--dim 1536] [--heads 12] [--ffn 4096] [--layers 0]
                              [--batch-size 4] [--seq-len 2048] [--steps 10] [--warmup 3] [--no-compile]
                              [--device cuda] [--json OUT.jsonl]

The peer is the usual dense recipe, what a well-tuned plain PyTorch LM step is: token embedding, `layers` pre-norm
blocks (RMSNorm; fused q/k/v projection, rotary embedding, causal `scaled_dot_product_attention` (flash attention
on a GPU); RMSNorm; SwiGLU MLP of width `ffn`), a final RMSNorm and an untied head of the matched model's
vocabulary; fp32 parameters under bf16 autocast (as Cedar's trainer), each block through `torch.compile` (regional,
as trainer.compile), the loss a plain cross-entropy, fused AdamW. `--layers 0` picks the depth whose training FLOPs
per token come closest to the `--match` model's (model/accounting.py's count at `--seq-len`: matmuls x 6, causal
attention at half the square), so MFU compares work done per second at equal work per token. This model's FLOPs
per token: 6 x its matmul parameters (head included, embedding not) + 6 x layers x seq_len x dim (QK^T and PV over
half the positions on average, forward and backward).

Prints the step time, tokens/s, the FLOPs per token of both models, and MFU against the bf16 matmul rate measured
here (an 8192^3 matmul, best of 10) and against the datasheet peak; `--json` appends the same as one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q, k = (_rope(t, cos, sin).transpose(1, 2) for t in (q, k))  # [B, H, T, Dh]
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on halves: x [B, T, H, Dh], cos / sin [T, Dh/2]."""
    a, b = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1).to(x.dtype)


class DenseLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.arange(seq_len)[:, None] * 10000.0 ** (-torch.arange(half) / half)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x)).float()

    def flops_per_token(self, seq_len: int) -> float:
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and not n.startswith("embed"))
        dim = self.head.weight.shape[1]
        return 6.0 * matmul + 6.0 * len(self.blocks) * seq_len * dim


def peer_flops(vocab: int, dim: int, layers: int, ffn: int, seq_len: int) -> float:
    """DenseLM.flops_per_token without building it."""
    per_layer = 4 * dim * dim + 3 * dim * ffn
    return 6.0 * (layers * per_layer + vocab * dim) + 6.0 * layers * seq_len * dim


def matmul_rate(device: torch.device) -> float:
    """Best bf16 FLOP/s of an 8192^3 matmul over 10 runs (trainer.metrics.measure_matmul_flops)."""
    from trainer.metrics import measure_matmul_flops

    return measure_matmul_flops(device, torch.bfloat16, size=8192, repeats=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--match", default="v41_small")
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--layers", type=int, default=0, help="0: the depth closest to --match's FLOPs per token")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import model as model_pkg
    from tests.helpers import load_config
    from trainer.metrics import device_peak_flops

    cfg = load_config(args.match)
    with torch.device("meta"):
        matched = model_pkg.build(cfg)
    target = matched.flops_per_token(args.seq_len)
    layers = args.layers or min(range(1, 200), key=lambda n: abs(
        peer_flops(cfg.vocab_size, args.dim, n, args.ffn, args.seq_len) - target))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = DenseLM(cfg.vocab_size, args.dim, layers, args.heads, args.ffn, args.seq_len).to(device)
    if not args.no_compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()  # float(): a host sync per step, as the trainer's logged loss
    wall = (time.perf_counter() - t0) / args.steps
    tokens = args.batch_size * args.seq_len
    flops = model.flops_per_token(args.seq_len)
    measured = matmul_rate(device) if cuda else device_peak_flops(device)
    datasheet = device_peak_flops(device)
    row = {"model": f"dense peer of {args.match}", "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "dim": args.dim, "layers": layers, "heads": args.heads, "ffn": args.ffn,
           "vocab": cfg.vocab_size, "params": sum(p.numel() for p in model.parameters()),
           "batch": args.batch_size, "seq_len": args.seq_len, "compiled": not args.no_compile,
           "flops_per_token": flops, "match_flops_per_token": target, "step_ms": wall * 1e3,
           "tokens_s": tokens / wall, "matmul_tflops_measured": measured / 1e12,
           "mfu_measured": flops * tokens / wall / measured, "mfu_datasheet": flops * tokens / wall / datasheet,
           "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
           "warmup_s": warmup_s, "loss": loss}
    print(f"dense peer of {args.match}: dim {args.dim}, {layers} layers, {args.heads} heads, SwiGLU {args.ffn}, "
          f"vocab {cfg.vocab_size} ({row['params'] / 1e6:.0f}M parameters); {flops / 1e9:.3f} GFLOP/token "
          f"({args.match}: {target / 1e9:.3f}); {args.batch_size} x {args.seq_len} tokens, "
          f"{'compiled' if row['compiled'] else 'eager'}")
    print(f"step {wall * 1e3:.1f} ms, {tokens / wall:,.0f} tokens/s, MFU {row['mfu_measured']:.1%} of the measured "
          f"bf16 matmul rate ({measured / 1e12:.0f} TFLOP/s), {row['mfu_datasheet']:.1%} of the datasheet's "
          f"({datasheet / 1e12:.0f}); peak {row['peak_gib']:.2f} GiB; warm-up {warmup_s:.1f} s; loss {loss:.4f}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
