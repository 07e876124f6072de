"""Parallel layouts on GPUs: equality with one GPU, then tokens/s and scaling efficiency.

    python bench/parallel_gpu.py [--model v41_small] [--layouts tp2,ep2,dp2] [--steps 60] [--seq-len 2048]

Three parts, all on this machine's GPUs (NCCL for the model's collectives, gloo beside it for bookkeeping):

1. Equality (`--check-steps`, default 3): the trainer's own code path (trainer.train.build_model ->
   compute_gradients, AdamW from optim/, router-bias updates) on fixed random global batches, one GPU against each
   layout, once in fp32 (TF32 off: every difference is summation order) and once under bf16 autocast. Every layout
   sees the same global batch (micro-batches split over its data ranks as the loader would). Prints the loss and
   the gradient norm of each step and their relative differences from one GPU.
2. Throughput (`--steps`): the CLI (`python -m torch.distributed.run ... -m trainer.cli.main`) on the prepared stdlib
   corpus, bf16, the model's default kernels; tokens/s is the median over the steps after `--warmup`, memory the
   peak allocated. Scaling efficiency = tokens/s of the layout / (GPUs x tokens/s of one GPU at the same
   per-data-rank batch). tp keeps one data rank (the same global batch as one GPU); ep and dp read one batch per
   GPU, so their global batch doubles.

3. Resume (`--parts resume`): each layout trains `--steps` steps saving at `--steps // 2`; one GPU resumes that
   checkpoint (torch.distributed.checkpoint reshards it) and trains to `--steps`; with one data rank on both sides
   (tp, cp) the resumed steps' losses are compared with the layout's own.

Long sequences under context parallelism, e.g. 64K tokens: `--layouts cp2 --parts throughput --seq-len 65536
--batch-size 1 parallel.activation_checkpoint=full` (one GPU runs the same sequence first, for the efficiency).

Writes one JSON line per result to --out (default bench_parallel_gpu.jsonl) and a table to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name -> (ParallelConfig fields, GPUs)
    "1gpu": ({}, 1),
    "1gpu_ref": ({}, 1),  # throughput only: one GPU with model.kernels=reference (the PyTorch path)
    "dp2": ({"dp_replicate": 2}, 2),
    "tp2": ({"tp": 2}, 2),
    "tp2_sp": ({"tp": 2, "sequence_parallel": True}, 2),
    "ep2": ({"ep": 2}, 2),
    "dp_shard2": ({"dp_shard": 2}, 2),
    "cp2": ({"cp": 2}, 2),
    "pp2": ({"pp": 2}, 2),
    # issue 6's full layouts (nvidia-h200-x4 / -x8)
    "tp2_ep2": ({"tp": 2, "ep": 2}, 4),
    "tp2_pp2_ep2": ({"tp": 2, "pp": 2, "ep": 2}, 8),
}


# -- part 1: equality ------------------------------------------------------------------------------------------------
def _global_batch(step: int, micro: int, rows: int, seq_len: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (micro, rows, seq_len + 1), generator=gen)
    return [{"input_ids": mb[:, :-1], "labels": mb[:, 1:]} for mb in ids]


def _equality_run(fields: dict, args: dict) -> dict:
    """One layout through the trainer's code path; losses and norms of every step (the same on every rank)."""
    from omegaconf import OmegaConf

    from model.config import ModelConfig
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from trainer.config import ParallelConfig, TrainerConfig
    from trainer.parallel.gradients import update_router_biases
    from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

    device = args["device"]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    y = OmegaConf.load(ROOT / "conf" / "model" / f"{args['model']}.yaml")
    y.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    cfg = dataclasses.replace(cfg, kernels=args["kernels"])
    parallel = ParallelConfig(**fields)
    rt = setup_runtime(TrainerConfig(device=device, precision=args["precision"], num_threads=1), parallel)
    data_rank, data_size = (0, 1) if rt.meshes is None else (rt.meshes.data.get_local_rank(), rt.meshes.data.size())
    micro = args["micro"]
    accum = micro // data_size
    pm = build_model(cfg, rt, parallel, 0, batch_size=args["rows"], seq_len=args["seq_len"], grad_accum=accum)
    params = trainable_parameters(pm.module, cfg)
    opt = build_optimizer(params, OptimConfig(lr=args["lr"], warmup_steps=0))
    pm.module.train()
    out = {"loss": [], "grad_norm": []}
    for step in range(args["steps"]):
        mine = _global_batch(step, micro, args["rows"], args["seq_len"], cfg.vocab_size)
        mine = mine[data_rank * accum:(data_rank + 1) * accum]
        stats = compute_gradients(pm, mine, params, 1.0, rt.autocast_dtype, step=step + 1)
        out["loss"].append(stats.loss)
        out["grad_norm"].append(stats.grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_router_biases(pm)
    out["memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
    return out


def _equality_worker(rank: int, world: int, fields: dict, args: dict) -> dict:
    return _equality_run(fields, args)


def equality(names: list[str], args: argparse.Namespace) -> list[dict]:
    from tests.distributed import run_distributed

    rows = []
    backend = "cuda:nccl,cpu:gloo" if args.device == "cuda" else "gloo"
    for precision in args.precisions.split(",") if args.device == "cuda" else ("fp32",):
        run_args = dict(model=args.model, kernels=args.kernels, device=args.device, precision=precision, rows=args.check_rows, seq_len=args.check_seq_len,
                        micro=args.check_micro, steps=args.check_steps, lr=args.lr)
        results = {}
        for name in ["1gpu", *(n for n in names if n != "1gpu_ref")]:
            fields, gpus = LAYOUTS[name]
            t0 = time.perf_counter()
            if gpus == 1:
                results[name] = run_distributed(_equality_worker, 1, fields, run_args, backend=backend)[0]
            else:
                per_rank = run_distributed(_equality_worker, gpus, fields, run_args, backend=backend)
                assert all(r["loss"] == per_rank[0]["loss"] for r in per_rank), f"{name}: ranks disagree on the loss"
                results[name] = per_rank[0]
            ref = results["1gpu"]
            res = results[name]
            loss_rel = max(abs(a - b) / abs(b) for a, b in zip(res["loss"], ref["loss"]))
            norm_rel = max(abs(a - b) / abs(b) for a, b in zip(res["grad_norm"], ref["grad_norm"]))
            row = dict(part="equality", layout=name, loss=res["loss"],
                       grad_norm=res["grad_norm"], max_loss_rel=loss_rel, max_grad_norm_rel=norm_rel,
                       memory_gb=res["memory_gb"], seconds=time.perf_counter() - t0, **run_args)
            print(json.dumps(row), flush=True)
            _save(args.out, row)
            rows.append(row)
    return rows


# -- part 2: throughput ----------------------------------------------------------------------------------------------
def _overrides(fields: dict) -> list[str]:
    return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]


def _prepare_data(args: argparse.Namespace) -> Path:
    data_path = Path(args.data_path)
    if not (data_path / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "data.prepare", "--out", str(data_path), "--vocab-size",
                        str(args.vocab_size), "--no-progress"], cwd=ROOT, check=True)
    return data_path


def _train(name: str, args: argparse.Namespace, run_dir: Path, *overrides: str) -> list[dict] | str:
    """One CLI training run of layout `name`; its metrics.jsonl records, or why there are none."""
    fields, gpus = LAYOUTS[name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "trainer.cli.main", f"model={args.model}", f"data.path={_prepare_data(args)}",
           f"data.vocab_size={args.vocab_size}", f"data.seq_len={args.seq_len}",
           f"data.batch_size={args.batch_size}", f"trainer.max_steps={args.steps}",
           f"trainer.grad_accum={args.grad_accum}", "logger.wandb.mode=disabled", "logger.progress_bar=false",
           "checkpoint.interval=0", "checkpoint.save_final=false", "checkpoint.resume=none",
           f"trainer.device={args.device}", f"hydra.run.dir={run_dir}", *_overrides(fields), *args.extra,
           *overrides]  # later overrides win
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: no result within --run-timeout {args.run_timeout} s", flush=True)
        return "timeout"
    if proc.returncode != 0:
        print(f"{name}: failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}", flush=True)
        return f"exit {proc.returncode}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def throughput(names: list[str], args: argparse.Namespace) -> list[dict]:
    rows, base = [], args.baseline_tps
    for name in dict.fromkeys(([] if base else ["1gpu"]) + names):
        fields, gpus = LAYOUTS[name]
        t0 = time.perf_counter()
        records = _train(name, args, Path(tempfile.mkdtemp(prefix=f"bench_{name}_")),
                         *(["model.kernels=reference"] if name == "1gpu_ref" else []))
        if isinstance(records, str):
            rows.append(dict(part="throughput", layout=name, failed=records))
            continue
        steady = [r for r in records if r["step"] > args.warmup]
        tps = statistics.median(r["tokens_per_s"] for r in steady)
        row = dict(part="throughput", layout=name, gpus=gpus, tokens_per_s=tps, tokens_per_s_per_gpu=tps / gpus,
                   mfu=statistics.median(r["mfu"] for r in steady), memory_gb=max(r["memory_mb"] for r in records) / 1e3,
                   first_loss=records[0]["loss"], last_loss=records[-1]["loss"], steps=len(records),
                   seconds=time.perf_counter() - t0, seq_len=args.seq_len, batch_size=args.batch_size,
                   extra=args.extra)
        if name == "1gpu":
            base = tps
        elif base:
            row["scaling_efficiency"] = tps / (gpus * base)
            if not ({"ep", "dp_replicate", "dp_shard"} & set(fields)):  # one data rank: the same global batch
                row["speedup_same_batch"] = tps / base
        print(json.dumps(row), flush=True)
        _save(args.out, row)
        rows.append(row)
    return rows


# -- part 3: save under a layout, resume on one GPU ------------------------------------------------------------------
def resume(names: list[str], args: argparse.Namespace) -> list[dict]:
    """Each layout trains `--steps` steps and saves at step `--steps // 2`; one GPU resumes that checkpoint and runs
    to `--steps`. With one data rank on both sides (tp, cp) both read the same batches after the resume, so the
    losses of the resumed steps are compared (bf16, nondeterministic atomics: expect bf16-sized differences); with
    more data ranks (ep, dp) the loader resumes elastically and only the continuation is checked."""
    rows = []
    half = args.steps // 2
    for name in names:
        fields, gpus = LAYOUTS[name]
        if gpus == 1:
            continue
        saved_dir = Path(tempfile.mkdtemp(prefix=f"resume_{name}_"))
        t0 = time.perf_counter()
        saved = _train(name, args, saved_dir, f"checkpoint.interval={half}")
        ckpt = next((d for d in (saved_dir / "checkpoints").glob("step_*") if int(d.name[5:]) == half), None)
        if isinstance(saved, str) or ckpt is None:
            rows.append(dict(part="resume", layout=name, failed=saved if isinstance(saved, str) else "no checkpoint"))
            continue
        resumed = _train("1gpu", args, Path(tempfile.mkdtemp(prefix=f"resumed_{name}_")),
                         f"checkpoint.resume={ckpt}")
        if isinstance(resumed, str):
            rows.append(dict(part="resume", layout=name, failed="1 GPU resume: " + resumed))
            continue
        after = {r["step"]: r["loss"] for r in saved if r["step"] > half}
        cont = {r["step"]: r["loss"] for r in resumed}
        row = dict(part="resume", layout=name, saved_at=half, resumed_steps=sorted(cont),
                   layout_losses=[after.get(k) for k in sorted(cont)], one_gpu_losses=[cont[k] for k in sorted(cont)],
                   seconds=time.perf_counter() - t0)
        if not ({"ep", "dp_replicate", "dp_shard"} & set(fields)) and sorted(cont) == sorted(after):
            row["max_loss_rel"] = max(abs(cont[k] - after[k]) / abs(after[k]) for k in cont)
        print(json.dumps(row), flush=True)
        _save(args.out, row)
        rows.append(row)
    return rows


def _save(path: str, row: dict) -> None:
    """Append one result as soon as it exists: a run cut short keeps what it measured."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v41_small")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script (gloo)")
    p.add_argument("--layouts", default="tp2,ep2,dp2")
    p.add_argument("--parts", default="equality,throughput")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--kernels", default="auto", help="model.kernels of the equality runs")
    p.add_argument("--precisions", default="fp32,bf16", help="of the equality runs")
    p.add_argument("--check-rows", type=int, default=2)
    p.add_argument("--check-seq-len", type=int, default=1024)
    p.add_argument("--check-micro", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds one throughput run may take")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--data-path", default=".data/stdlib32k")
    p.add_argument("--out", default="bench_parallel_gpu.jsonl")
    p.add_argument("--baseline-tps", type=float, default=None,
                   help="one GPU's tokens/s at the same settings, measured before: the throughput part skips its run")
    p.add_argument("extra", nargs="*", help="more Hydra overrides for the throughput runs")
    args = p.parse_args()
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    needed = max(LAYOUTS[n][1] for n in ["1gpu", *names])
    if args.device == "cuda" and torch.cuda.device_count() < needed:
        p.error(f"the layouts need {needed} GPUs, this machine has {torch.cuda.device_count()}")
    rows = []
    parts = args.parts.split(",")
    if "equality" in parts:
        rows += equality(names, args)
    if "throughput" in parts:
        rows += throughput(names, args)
    if "resume" in parts:
        rows += resume(names, args)
    print(f"\n{'part':<11}{'layout':<10}{'prec':<6}{'loss rel':>10}{'norm rel':>10}{'tok/s':>11}{'tok/s/GPU':>11}"
          f"{'MFU':>7}{'eff':>7}{'mem GB':>8}")
    for r in rows:
        if r["part"] == "resume":
            if not r.get("failed"):
                print(f"{'resume':<11}{r['layout']:<10}{'bf16':<6}{r.get('max_loss_rel', math.nan):>10.2e}"
                      f"  (saved at step {r['saved_at']} under {r['layout']}, resumed on 1 GPU)")
                continue
        if r.get("failed"):
            print(f"{r['part']:<11}{r['layout']:<10}FAILED ({r['failed']})")
        elif r["part"] == "equality":
            print(f"{'equality':<11}{r['layout']:<10}{r['precision']:<6}{r['max_loss_rel']:>10.2e}"
                  f"{r['max_grad_norm_rel']:>10.2e}{'':>11}{'':>11}{'':>7}{'':>7}{r['memory_gb']:>8.1f}")
        else:
            eff = r.get("scaling_efficiency", math.nan)
            print(f"{'throughput':<11}{r['layout']:<10}{'bf16':<6}{'':>10}{'':>10}{r['tokens_per_s']:>11.0f}"
                  f"{r['tokens_per_s_per_gpu']:>11.0f}{r['mfu']:>7.3f}{eff:>7.2f}{r['memory_gb']:>8.1f}")


if __name__ == "__main__":
    main()
