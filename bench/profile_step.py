"""Where one training step's time goes, eager vs compiled: torch.profiler over the trainer's own step on one device.

    python bench/profile_step.py [--model v41_small] [--batch-size 4] [--seq-len 2048] [--kernels auto]
                                 [--modes eager,compiled] [--steps 3] [--warmup 3] [--top 25] [--trace trace.json]
                                 [--gemm-shapes] [--op-sources] [--compile-mode reduce-overhead] [--fp8]

Builds the model and runs steps exactly as the trainer does (trainer.train.build_model -> compute_gradients, bf16
autocast on CUDA, AdamW from optim/), on random token batches, once per mode: `eager`, `compiled` (trainer.compile:
every block through torch.compile, trainer/parallel/compile.py), each optionally `+fused` (trainer.fused_loss: the
head and the cross-entropy chunked, trainer/fused_loss.py). Per mode, after `--warmup` steps (compilation
included) it times `--steps` steps without the profiler, then profiles `--steps` more and prints: the step time,
tokens/s and MFU (the model's training FLOPs per token, model/accounting.py, over the device's measured bf16 matmul
rate); operators dispatched per step (aten:: ops seen by the profiler, nested calls included; the `--top` by calls)
and the outermost ones (called from Python, a compiled graph or an autograd node, not from inside another
operator), kernel launches per step (CUDA), the optimiser step's wall time; the device time by kernel family (GEMMs, the Triton kernels by module,
elementwise, reductions, copies, communication, other) and the `--top` kernels. A last table compares the modes.
`--trace` writes each mode's Chrome trace (mode name appended). On CPU the "device time" is the CPU ops' self time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
    (r"sparse_attn_fwd", "triton: sparse attention fwd"),
    (r"bwd_probs|bwd_dq|bwd_dkv", "triton: sparse attention bwd"),
    (r"_index|_score|_pool|_block_max", "triton: indexer"),
    (r"_topk", "triton: top-k"),
    (r"mhc|_coeff", "triton: mHC"),
    (r"engram|_gather_rows|_gate|_gather_kernel|_scatter_add_kernel", "triton: Engram"),
    (r"norm_rope|_nrq", "triton: norm+RoPE+quant"),
    (r"_fp8_gemm_kernel", "triton: FP8 GEMM"),
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


def _mode(name: str) -> tuple[bool, bool]:
    parts = name.split("+")
    if parts[0] not in ("eager", "compiled") or any(p != "fused" for p in parts[1:]):
        raise SystemExit(f"--modes: {name!r} is not eager, compiled, eager+fused or compiled+fused")
    return parts[0] == "compiled", "fused" in parts[1:]


GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm", "aten::linear",
         "aten::matmul")


def gemm_table(prof, steps: int, cuda: bool) -> None:
    """The GEMM operators of the profiled steps by input shapes and dtypes: calls and time per step, a `*` where a
    matrix dimension is not a multiple of 8 (the misaligned tensor-core kernels' cause)."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in GEMMS:
            continue
        us = (ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total) if cuda \
            else ev.cpu_time_total
        shapes = [s for s in ev.input_shapes if s]
        odd = any(d % 8 for s in shapes if len(s) >= 2 for d in s[-2:])
        rows.append((us / steps, ev.count / steps, ev.key, shapes, odd))
    print(f"\n{'GEMM operator, input shapes':96s} {'ms/step':>9s} {'calls':>6s}")
    for us, n, key, shapes, odd in sorted(rows, key=lambda r: -r[0])[:40]:
        print(f"{('* ' if odd else '  ') + key + ' ' + str(shapes)[:86]:96s} {us / 1e3:9.2f} {n:6.0f}")


def _source(ev) -> str:
    """Where an operator was dispatched from: the nearest enclosing range that is not an operator (a compiled graph's
    call, the optimiser's step, an autograd node), or "(top level)"."""
    p = ev.cpu_parent
    while p is not None and p.name.startswith("aten::"):
        p = p.cpu_parent
    if p is None:
        return "(top level)"
    name = p.name
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled graph"
    return name[:60]


def _outermost(ev) -> bool:
    """An operator no other operator dispatched: one Python, a compiled graph or an autograd node called (its nested
    operators are C++ calls inside it, e.g. the per-group views and GEMMs of CPU's `_grouped_mm`)."""
    return ev.cpu_parent is None or not ev.cpu_parent.name.startswith("aten::")


def source_table(prof, steps: int, top: int) -> None:
    """Outermost operators (those no other operator dispatched) by where they came from, and all operators, nested
    included, by the same sources: what is left outside the compiled graphs."""
    outer: dict[tuple[str, str], int] = defaultdict(int)
    nested: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith("aten::"):
            continue
        src = _source(ev)
        nested[src] += 1
        if _outermost(ev):
            outer[(src, ev.name)] += 1
    print(f"\n{'operators (nested included) by source':90s} {'calls':>9s}")
    for src, n in sorted(nested.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{src[:90]:90s} {n / steps:9,.0f}")
    print(f"\n{'outermost operators by source':90s} {'calls':>9s}")
    for (src, op), n in sorted(outer.items(), key=lambda kv: -kv[1])[:2 * top]:
        print(f"{(src + ': ' + op)[:90]:90s} {n / steps:9,.0f}")


def run_mode(args, name: str, fullgraph: bool = True) -> dict:
    from omegaconf import OmegaConf

    from model.config import ModelConfig
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from trainer.config import ParallelConfig, TrainerConfig
    from trainer.loss import LMLoss
    from trainer.metrics import device_peak_flops
    from trainer.parallel.gradients import update_router_biases
    from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

    compiled, fused = _mode(name)
    y = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    y.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    cfg = dataclasses.replace(cfg, kernels=args.kernels, fp8_gemm=args.fp8)
    cuda = args.device == "cuda"
    parallel = ParallelConfig(activation_checkpoint=args.activation_checkpoint)
    rt = setup_runtime(TrainerConfig(device=args.device, precision="bf16" if cuda else "fp32",
                                     num_threads=args.threads), parallel)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    from trainer.parallel.compile import compile_blocks

    counters.clear()
    pm = build_model(cfg, rt, parallel, 0, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=1)
    if compiled:  # one process: compiling after materialize is what build_model's compile_backend does before it
        compile_blocks(pm.module, args.backend, fullgraph=fullgraph, mode=args.compile_mode)
    params = trainable_parameters(pm.module, cfg)
    opt = build_optimizer(params, OptimConfig(lr=3e-4, warmup_steps=0))
    pm.module.train()
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    opt_time, losses = [], []

    def step(i: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        stats = compute_gradients(pm, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], params, 1.0, rt.autocast_dtype,
                          step=i + 1, loss=LMLoss(fused=fused))
        losses.append(stats.loss)
        sync()
        t = time.perf_counter()
        opt.step()
        sync()
        opt_time.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
        update_router_biases(pm)

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:  # the earlier modes' cached blocks go back, so that "reserved" is this mode's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    opt_time.clear()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    opt_s = sum(opt_time) / len(opt_time)
    # allocated: the tensors' peak; reserved: what the allocator holds, CUDA graphs' private memory pools included
    # (a recorded graph's activations live in its pool, which the allocated count does not see)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    reserved_gb = torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, record_shapes=args.gemm_shapes) as prof:
        for i in range(args.steps):
            step(args.warmup + args.steps + i)
        sync()
    if args.trace:
        prof.export_chrome_trace(args.trace.replace(".json", f".{name}.json"))

    # device time per kernel: the CUDA events (kernels, memcpy/memset) on CUDA, the CPU ops' self time on CPU
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    ops = outer = launches = 0
    op_calls: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU:
            if ev.name.startswith("aten::"):
                ops += 1
                op_calls[ev.name] += 1
                outer += _outermost(ev)
            if ev.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                           "cudaGraphLaunch"):  # a CUDA graph's replay is one launch of the host
                launches += 1
        if cuda:
            # on the device track: kernels, memcpy / memset, and the ranges that annotate them (a compiled graph's
            # "## Call CompiledFxGraph ... ##", "Optimizer.step#AdamW.step"), which would count their kernels twice
            if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False) \
                    or ev.name.startswith(("## ", "Optimizer.")):
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
    if compiled and args.compile_mode != "default":
        name += f"[{args.compile_mode}]"
    print(f"\n=== {name}: {args.model}  {args.batch_size} x {args.seq_len} tokens  kernels={args.kernels}  "
          f"fp8_gemm={args.fp8}  device={args.device}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"warm-up {warmup_s:.1f} s ({args.warmup} steps, compilation included); step {wall * 1e3:.1f} ms wall "
          f"(unprofiled), {busy * 1e3:.1f} ms device-busy (profiled), {tokens / wall:,.0f} tokens/s, "
          f"MFU {flops / wall / peak:.1%} (peak {peak / 1e12:.0f} TFLOP/s); {ops / args.steps:,.0f} operators "
          f"dispatched / step ({outer / args.steps:,.0f} outermost), {launches / args.steps:,.0f} kernel launches / step; optimiser step {opt_s * 1e3:.1f} ms"
          + (f"; peak memory {peak_gb:.2f} GiB allocated, {reserved_gb:.2f} GiB reserved" if cuda else ""))
    fams: dict[str, float] = defaultdict(float)
    for kname, (us, _) in per_kernel.items():
        fams[family(kname)] += us
    breaks = sum(counters["graph_break"].values())
    if compiled:
        print(f"graph breaks: {breaks}" + "".join(f"\n  {n}x {r[:300]}" for r, n in counters["graph_break"].items()))
    print(f"\n{'family':42s} {'ms/step':>9s} {'share':>7s}")
    for fam, us in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"{fam:42s} {us / 1e3:9.2f} {100 * us / 1e6 / max(busy, 1e-12):6.1f}%")
    print(f"\n{'top kernels':90s} {'ms/step':>9s} {'calls':>6s}")
    for kname, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{kname[:90]:90s} {us / 1e3:9.2f} {n // args.steps:6d}")
    print(f"\n{'operators by calls (nested included)':90s} {'calls':>9s}")
    for oname, n in sorted(op_calls.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{oname[:90]:90s} {n / args.steps:9,.0f}")
    if args.op_sources:
        source_table(prof, args.steps, args.top)
    if args.gemm_shapes:
        gemm_table(prof, args.steps, cuda)
    return {"mode": name, "step_ms": wall * 1e3, "busy_ms": busy * 1e3, "tokens_s": tokens / wall,
            "mfu": flops / wall / peak, "flops_s": flops / wall, "ops": ops / args.steps, "outer_ops": outer / args.steps, "launches": launches / args.steps,
            "opt_ms": opt_s * 1e3, "peak_gb": peak_gb, "reserved_gb": reserved_gb, "warmup_s": warmup_s, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v41_small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--fp8", action="store_true", help="model.fp8_gemm=true: FP8 GEMMs (kernels/fp8_gemm.py)")
    p.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled, each with +fused")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled modes")
    p.add_argument("--compile-mode", default="default",
                   help="torch.compile mode of the compiled modes (trainer.compile_mode): default, reduce-overhead "
                        "(CUDA graphs), max-autotune-no-cudagraphs, max-autotune")
    p.add_argument("--activation-checkpoint", default="none", help="parallel.activation_checkpoint (none, full, ...)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (trainer.num_threads; 0: the cores)")
    p.add_argument("--trace", default=None)
    p.add_argument("--gemm-shapes", action="store_true",
                   help="record input shapes: a table of the GEMM operators by shape (* = a dimension not a multiple of 8)")
    p.add_argument("--op-sources", action="store_true",
                   help="tables of the operators by where they were dispatched from (a compiled graph, the optimiser, "
                        "an autograd node, the top level)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="append each mode's row (and the measured matmul rate) to this file")
    args = p.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        _mode(m)
    rows = []
    for m in modes:
        try:
            rows.append(run_mode(args, m))
        except Exception as e:  # a graph break under fullgraph: report it, then find the breaks
            if not _mode(m)[0]:
                raise
            print(f"\n=== {m}: failed with fullgraph=True: {type(e).__name__}: {str(e)[:2000]}")
            rows.append(run_mode(args, m, fullgraph=False))
            rows[-1]["mode"] = m + "(breaks)"
    base = rows[0]
    # every mode starts from the same initial weights and sees the same batches: its losses step by step
    print("\nlosses by step (same weights and batches in every mode):")
    for r in rows:
        print(f"{r['mode']:32s} " + " ".join(f"{v:.5f}" for v in r["losses"]))
    print(f"\n{'mode':32s} {'step ms':>9s} {'vs ' + base['mode']:>14s} {'ops/step':>10s} {'vs':>7s} "
          f"{'outermost':>10s} {'vs':>7s} {'launches':>9s} {'optim ms':>9s} {'MFU':>7s} {'peak GiB':>9s} {'reserved':>9s} "
          f"{'warm-up s':>10s}")
    for r in rows:
        print(f"{r['mode']:32s} {r['step_ms']:9.1f} {base['step_ms'] / r['step_ms']:13.2f}x {r['ops']:10,.0f} "
              f"{base['ops'] / max(r['ops'], 1):6.1f}x {r['outer_ops']:10,.0f} {base['outer_ops'] / max(r['outer_ops'], 1):6.1f}x "
              f"{r['launches']:9,.0f} {r['opt_ms']:9.1f} {r['mfu']:7.1%} "
              f"{r['peak_gb']:9.2f} {r['reserved_gb']:9.2f} {r['warmup_s']:10.1f}")
    if args.device.startswith("cuda"):  # MFU against the bf16 matmul rate this GPU delivers, measured now
        sys.path.insert(0, str(ROOT / "bench"))
        from peer_step import matmul_rate

        rate = matmul_rate(torch.device(args.device))
        print(f"\nmeasured bf16 matmul rate (8192^3, best of 10): {rate / 1e12:.0f} TFLOP/s; MFU against it: "
              + ", ".join(f"{r['mode']} {r['flops_s'] / rate:.1%}" for r in rows))
        for r in rows:
            r["matmul_tflops_measured"], r["mfu_measured"] = rate / 1e12, r["flops_s"] / rate
    if args.json:
        import json

        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"model": args.model, "batch": args.batch_size, "seq_len": args.seq_len,
                                    "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                                    **r}) + "\n")


if __name__ == "__main__":
    main()
