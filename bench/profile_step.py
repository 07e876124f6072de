"""Where one training step's time goes: torch.profiler over the trainer's own step on one device.

    python bench/profile_step.py [--model v41_small] [--batch-size 4] [--seq-len 2048] [--kernels auto]
                                 [--steps 3] [--warmup 3] [--top 25] [--trace trace.json]

Builds the model and runs steps exactly as the trainer does (trainer.train.build_model -> compute_gradients, bf16
autocast on CUDA, AdamW from optim/), on random token batches. After `--warmup` steps it profiles `--steps` steps
and prints: the step time, tokens/s and MFU (the model's training FLOPs per token, model/accounting.py, over the
device's measured bf16 matmul rate); the device time by kernel family (GEMMs, the Triton kernels by module,
elementwise, reductions, copies, communication, other); and the `--top` kernels by device time. `--trace` also
writes a Chrome trace. On CPU it runs as a dry run of the script (CPU op times).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# kernel-name pattern -> family; first match wins (Triton kernels keep their Python function names)
FAMILIES = [
    (r"_sparse_attn_fwd", "triton: sparse attention fwd"),
    (r"_bwd_probs|_bwd_dq|_bwd_dkv", "triton: sparse attention bwd"),
    (r"_index|_score|_pool", "triton: indexer"),
    (r"_topk", "triton: top-k"),
    (r"mhc|_coeff", "triton: mHC"),
    (r"engram|_gather_rows|_gate", "triton: Engram"),
    (r"norm_rope|_nrq", "triton: norm+RoPE+quant"),
    (r"fp4|fp8|_quant|_dequant", "triton: FP4/FP8"),
    (r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|alltoall", "communication"),
    (r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul|wgmma", "GEMM (cuBLAS/CUTLASS)"),
    (r"flash|fmha|attention|sdpa", "dense attention (SDPA)"),
    (r"reduce|softmax|norm|sum|max|topk|sort|scan|cumsum", "reductions / softmax / sort"),
    (r"copy|memcpy|memset|cat|index|gather|scatter|fill", "copies / gathers / scatters"),
    (r"elementwise|vectorized|unrolled|pointwise|triton_poi", "elementwise"),
]


def family(name: str) -> str:
    low = name.lower()
    for pattern, fam in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v41_small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from omegaconf import OmegaConf

    from model.config import ModelConfig
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from trainer.config import ParallelConfig, TrainerConfig
    from trainer.metrics import device_peak_flops
    from trainer.parallel.gradients import update_router_biases
    from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

    y = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    y.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    cfg = dataclasses.replace(cfg, kernels=args.kernels)
    cuda = args.device == "cuda"
    parallel = ParallelConfig()
    rt = setup_runtime(TrainerConfig(device=args.device, precision="bf16" if cuda else "fp32"), parallel)
    pm = build_model(cfg, rt, parallel, 0, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=1)
    params = trainable_parameters(pm.module, cfg)
    opt = build_optimizer(params, OptimConfig(lr=3e-4, warmup_steps=0))
    pm.module.train()
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        compute_gradients(pm, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], params, 1.0, rt.autocast_dtype,
                          step=i + 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_router_biases(pm)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup):
        step(i)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.steps):
            step(args.warmup + i)
        sync()
    wall = (time.perf_counter() - t0) / args.steps
    if args.trace:
        prof.export_chrome_trace(args.trace)

    # device time per kernel: the CUDA events (kernels, memcpy/memset) on CUDA, the CPU ops' self time on CPU
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if cuda:
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        else:
            us = ev.self_cpu_time_total
        per_kernel[ev.name][0] += us / args.steps
        per_kernel[ev.name][1] += 1
    busy = sum(v[0] for v in per_kernel.values()) / 1e6  # seconds of device time per step
    tokens = args.batch_size * args.seq_len
    flops = pm.module.flops_per_token(args.seq_len) * tokens if hasattr(pm.module, "flops_per_token") else 0.0
    peak = device_peak_flops(rt.device)
    print(f"{args.model}  {args.batch_size} x {args.seq_len} tokens  kernels={args.kernels}  device={args.device}"
          f"  torch {torch.__version__}")
    print(f"step {wall * 1e3:.1f} ms wall, {busy * 1e3:.1f} ms device-busy ({100 * busy / wall:.0f}%), "
          f"{tokens / wall:,.0f} tokens/s, MFU {flops / wall / peak:.1%} (peak {peak / 1e12:.0f} TFLOP/s measured)")
    fams: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        fams[family(name)] += us
    print(f"\n{'family':42s} {'ms/step':>9s} {'share':>7s}")
    for fam, us in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"{fam:42s} {us / 1e3:9.2f} {100 * us / 1e6 / busy:6.1f}%")
    print(f"\n{'top kernels':90s} {'ms/step':>9s} {'calls':>6s}")
    for name, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{name[:90]:90s} {us / 1e3:9.2f} {n // args.steps:6d}")


if __name__ == "__main__":
    main()
