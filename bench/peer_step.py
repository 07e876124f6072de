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


class Attention(nn.Module):
    """Fused q/k/v projection, rotary embedding, causal `scaled_dot_product_attention` (flash attention on a GPU),
    output projection: x [B, T, D] -> [B, T, D], heads of D / heads."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q, k = (rope(t, cos, sin).transpose(1, 2) for t in (q, k))  # [B, H, T, Dh]
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.o(a.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on halves: x [B, T, H, Dh], cos / sin [T, Dh/2]."""
    a, b = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1).to(x.dtype)


def rope_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq_len, head_dim / 2] fp32 of the rotary angles (base 10000)."""
    half = head_dim // 2
    angles = torch.arange(seq_len)[:, None] * 10000.0 ** (-torch.arange(half) / half)
    return angles.cos(), angles.sin()


class DenseLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(dim // heads, seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
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


def match_config(name: str):
    """conf/model/<name>.yaml as the trainer reads it (model.config.ModelConfig); an unknown name exits with one
    line (code 2)."""
    from tests.helpers import ROOT, load_config  # the CLI's start-up: OmegaConf and the model package load here

    if not (ROOT / "conf" / "model" / f"{name}.yaml").is_file():
        fail(f"--match: no model config conf/model/{name}.yaml")
    return load_config(name)


def match_flops(cfg, seq_len: int) -> float:
    """The training FLOPs per token of the Cedar model `cfg` at `seq_len` (model/accounting.py, built on meta)."""
    import model as model_pkg  # the CLI's start-up: the model package loads here

    with torch.device("meta"):
        matched = model_pkg.build(cfg)
    return matched.flops_per_token(seq_len)  # outside the meta context: the count's own tensors are real


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The arguments every peer takes: the matched model, the batch, the timing, the device and the JSON file."""
    p.add_argument("--match", default="v41_small")
    p.add_argument("--layers", type=int, default=0, help="0: the depth closest to --match's FLOPs per token")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)


def check_step_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.layers < 0 or args.warmup < 0:
        fail(f"--layers and --warmup must be at least 0, got {args.layers} and {args.warmup}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA device here")


def lm_step(model: nn.Module, vocab: int, args: argparse.Namespace, device: torch.device, after=None):
    """One training step of a peer LM on random tokens (bf16 autocast, fused AdamW on CUDA), returning its loss;
    `after()` runs after the optimiser step (the MoE peer's router-bias update)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after is not None:
            after()
        return float(loss.detach())

    return step


def time_steps(step, args: argparse.Namespace, cuda: bool) -> tuple[float, float, float]:
    """`args.warmup` calls of step() (compilation included), then `args.steps` timed ones -> (seconds per step,
    warm-up seconds, the last step's loss). On CUDA the peak-memory counter restarts after the warm-up."""
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
    return (time.perf_counter() - t0) / args.steps, warmup_s, loss


def report(description: str, label: str, fields: dict, model: nn.Module, flops: float, target: float,
           timing: tuple[float, float, float], args: argparse.Namespace, device: torch.device) -> dict:
    """Prints `description` and the step line (time, tokens/s, MFU against the bf16 matmul rate measured now and
    against the datasheet, peak memory); returns the row (`label`, the device, `fields`, the timing), appended to
    `args.json` as one line when given."""
    from trainer.metrics import device_peak_flops

    wall, warmup_s, loss = timing
    cuda = device.type == "cuda"
    tokens = args.batch_size * args.seq_len
    measured = matmul_rate(device) if cuda else device_peak_flops(device)
    datasheet = device_peak_flops(device)
    row = {"model": label, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           **fields, "params": sum(p.numel() for p in model.parameters()),
           "batch": args.batch_size, "seq_len": args.seq_len, "compiled": not args.no_compile,
           "flops_per_token": flops, "match_flops_per_token": target, "step_ms": wall * 1e3,
           "tokens_s": tokens / wall, "tflops_s": flops * tokens / wall / 1e12,
           "matmul_tflops_measured": measured / 1e12,
           "mfu_measured": flops * tokens / wall / measured, "mfu_datasheet": flops * tokens / wall / datasheet,
           "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
           "warmup_s": warmup_s, "loss": loss}
    print(f"{description}; {flops / 1e9:.3f} GFLOP/token ({args.match}: {target / 1e9:.3f}); {args.batch_size} x "
          f"{args.seq_len} tokens, {'compiled' if row['compiled'] else 'eager'}")
    print(f"step {wall * 1e3:.1f} ms, {tokens / wall:,.0f} tokens/s, {row['tflops_s']:.1f} TFLOP/s, "
          f"MFU {row['mfu_measured']:.1%} of the measured bf16 matmul rate ({measured / 1e12:.0f} TFLOP/s), "
          f"{row['mfu_datasheet']:.1%} of the datasheet's ({datasheet / 1e12:.0f}); peak {row['peak_gib']:.2f} GiB; "
          f"warm-up {warmup_s:.1f} s; loss {loss:.4f}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(p)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=4096)
    args = p.parse_args()
    check_step_args(args)
    if args.dim < 1 or args.heads < 1 or args.ffn < 1 or args.dim % args.heads:
        fail(f"--dim {args.dim}, --heads {args.heads}, --ffn {args.ffn}: positive, dim a multiple of heads")

    cfg = match_config(args.match)
    target = match_flops(cfg, args.seq_len)
    layers = args.layers or min(range(1, 200), key=lambda n: abs(
        peer_flops(cfg.vocab_size, args.dim, n, args.ffn, args.seq_len) - target))
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = DenseLM(cfg.vocab_size, args.dim, layers, args.heads, args.ffn, args.seq_len).to(device)
    if not args.no_compile:
        for block in model.blocks:
            block.compile()
    timing = time_steps(lm_step(model, cfg.vocab_size, args, device), args, device.type == "cuda")
    params = sum(p.numel() for p in model.parameters())
    report(f"dense peer of {args.match}: dim {args.dim}, {layers} layers, {args.heads} heads, SwiGLU {args.ffn}, "
           f"vocab {cfg.vocab_size} ({params / 1e6:.0f}M parameters)", f"dense peer of {args.match}",
           {"dim": args.dim, "layers": layers, "heads": args.heads, "ffn": args.ffn, "vocab": cfg.vocab_size},
           model, model.flops_per_token(args.seq_len), target, timing, args, device)


if __name__ == "__main__":
    main()
