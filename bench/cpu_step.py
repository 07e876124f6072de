"""CPU training-step time of v41_tiny (forward + backward + AdamW step), with baselines measured in the same run.

Usage: .venv/bin/python bench/cpu_step.py [--batch 8] [--seq 128] [--steps 10]

Variants: the default (single-pass mHC), the unfused mHC formulation, and FP4/FP8 fake-quant on (the QAT hook's
cost). Prints one line per variant: median step time, tokens/s and useful TFLOP/s (model.flops_per_token).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import build_tiny, load_config  # noqa: E402
from trainer.parallel.apply import ParallelModel  # noqa: E402
from trainer.parallel.gradients import update_router_biases  # noqa: E402


def time_variant(name: str, overrides: dict, batch: int, seq: int, steps: int) -> dict:
    m = build_tiny(**overrides)
    opt = torch.optim.AdamW(m.trainable_parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, m.cfg.vocab_size, (batch, seq + 1), generator=g)
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        fwd = m(ids[:, :-1], outputs=True)
        logits, aux = fwd.logits, fwd.aux
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + aux.get("indexer_kl", 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_router_biases(ParallelModel.local(m))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tok = batch * seq / step
    return dict(variant=name, step_s=step, tokens_per_s=tok, tflops=tok * m.flops_per_token(seq) / 1e12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    base = load_config("v41_tiny")
    variants = {
        "default (single-pass mHC)": {},
        "baseline: unfused mHC": {"mhc": dataclasses.replace(base.mhc, impl="unfused")},
        "QAT on (FP4 main KV + indexer, FP8 SWA)": {
            "quant": dataclasses.replace(base.quant, main_kv="fp4", index="fp4", swa_kv="fp8")},
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch} x seq {args.seq}")
    for name, over in variants.items():
        r = time_variant(name, over, args.batch, args.seq, args.steps)
        print(f"{r['variant']:45s} step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tok/s  "
              f"{r['tflops'] * 1e3:7.2f} GFLOP/s useful")


if __name__ == "__main__":
    main()
