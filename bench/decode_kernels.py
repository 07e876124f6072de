"""The decode step on the serving kernels (`decode_step(..., kernels="triton")`, model/serving_decode.py) against the
reference step, issue 40: equality, time per step op by op and replayed from a CUDA graph, and kernels per layer.

  python3 bench/decode_kernels.py [--model v41_small] [--context 4096] [--batch-sizes 1,32] [--steps 20]
                                  [--precision bf16|fp32] [--check-steps 4] [--no-count] [--json OUT.jsonl]
                                  [--modes static,kernels,graph,graph+kernels[,compiled,compiled+kernels]]

Per batch size, on caches of --context tokens a row (bench/generation.py's synthetic_fill: random stored entries and
ring rows, the counts set; a step's work depends on the counts, not the values):
- check: two caches filled alike, fed the same tokens for --check-steps steps by the reference and the kernel step:
  max |logits difference| per step, whether the argmax agrees (and the reference's top-2 margin where it does not),
  and whether the caches' stored bytes still agree afterwards (the fraction of bytes that differ);
- time: the median ms per step of the reference step op by op ("static"), the kernel step op by op ("kernels"), and
  both replayed from a CUDA graph ("graph", "graph+kernels": trainer/engine/engine.py's _DecodeGraph, what
  Engine(cuda_graph=True) runs), each timed in turn on its own cache (one graph alive at a time, as in the
  engine), with the speed-up of each over "static";
- kernels (at the first batch size; not with --no-count): the device kernels one step launches, in all and per
  layer role (swa, full, reindex, reuse: torch.profiler over each block's call alone, the mean over the role's
  layers), for the reference and the kernel step; the report's figure is 11 per Reuse layer.
The compiled modes (not by default: compiling v41_small takes minutes a batch size): `compiled` is the reference
step and `compiled+kernels` the kernel step, each through torch.compile (model.serving.compiled_decode_step, Inductor,
fullgraph) and replayed from a CUDA graph (Engine(cuda_graph=True, compile_decode="inductor")); the check then also
compares each compiled step with the reference op by op, and the kernel count covers the compiled step too.
Random weights, bf16 autocast by default (--precision fp32: the fp32 equality check on the GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generation import build, random_ids, synthetic_fill  # noqa: E402
from model.serving import compiled_decode_step, decode_step  # noqa: E402
from trainer.engine.engine import _DecodeGraph  # noqa: E402

MODES = ("static", "kernels", "graph", "graph+kernels", "compiled", "compiled+kernels")
DEFAULT_MODES = "static,kernels,graph,graph+kernels"


def step_fn(m, mode: str):
    """The step a mode runs, (ids, cache) -> logits, op by op or compiled (the graph modes capture it)."""
    kernels = "triton" if mode.endswith("kernels") else "reference"
    if mode.startswith("compiled"):
        return compiled_decode_step(m, "inductor", kernels)
    return functools.partial(decode_step, m, kernels=kernels)


def filled(m, B: int, n: int, max_len: int):
    cache = m.new_cache(B, max_len, replay="none")
    synthetic_fill(m, cache, n, 3)
    return cache


def cache_bytes(cache) -> list[torch.Tensor]:
    out = []
    for lc in cache.layers.values():
        for store in (lc.swa, lc.main, lc.keys):
            if store is not None:
                out += [b.view(torch.uint8) if b.element_size() == 1 else b for b in store.buffers]
    return out


def check(m, B: int, n: int, steps: int, autocast, modes, max_len: int) -> dict:
    """Each mode's step (op by op, or compiled without a graph) against the reference step op by op, fed the same
    tokens from equal caches of max_len (the timed caches' shape: a compiled step compiles once a shape)."""
    ref = filled(m, B, n, max_len)
    fast = {mode: (step_fn(m, mode), filled(m, B, n, max_len)) for mode in modes}
    errs, same, margins = defaultdict(list), defaultdict(list), []
    with torch.no_grad(), autocast():
        for i in range(steps):
            tok = random_ids(m.cfg, B, 1, 50 + i, ref.lengths.device)
            want = decode_step(m, tok, ref).float()
            top2 = want[:, 0].topk(2, -1).values
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
            for mode, (step, cache) in fast.items():
                got = step(tok, cache).float()
                errs[mode].append(float((got - want).abs().max()))
                same[mode].append(bool((got[:, 0].argmax(-1) == want[:, 0].argmax(-1)).all()))
    out = dict(ref_top2_margin=margins)
    for mode, (_, cache) in fast.items():
        diff = [float((a != b).float().mean()) for a, b in zip(cache_bytes(ref), cache_bytes(cache))]
        print(f"  check {mode}, {steps} steps from equal caches: max |d logits| "
              f"{' '.join(f'{e:.2e}' for e in errs[mode])}; argmax "
              f"{' '.join('=' if s else f'NO(margin {mg:.1e})' for s, mg in zip(same[mode], margins))}; cache bytes "
              f"that differ afterwards: at most {max(diff):.2e} of a buffer")
        out[mode] = dict(max_abs=errs[mode], argmax_equal=same[mode], cache_bytes_differ=max(diff))
    return out


def kernels_by_role(m, step, tok, cache, by_role: bool = True) -> dict:
    """Device kernels of one step: total and mean per layer role (each block's call profiled on its own; a compiled
    step, whose blocks run no hooks: by_role=False, the total and its mean per layer)."""
    from torch.profiler import ProfilerActivity, profile  # (the profiler only where kernels are counted)

    def count(fn) -> int:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset")))

    per_layer: dict[int, int] = {}
    open_prof = {}

    def pre(i):
        def hook(_module, _inputs):
            torch.cuda.synchronize()
            open_prof[i] = profile(activities=[ProfilerActivity.CUDA])
            open_prof[i].__enter__()
        return hook

    def post(i):
        def hook(_module, _inputs, _out):
            torch.cuda.synchronize()
            prof = open_prof.pop(i)
            prof.__exit__(None, None, None)
            per_layer[i] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                               and not e.name.startswith(("Memcpy", "Memset")))
        return hook

    total = count(lambda: step(tok, cache))
    if not by_role:
        return dict(total=total, per_layer=total / len(m.layers), roles={}, outside_layers=None)
    handles = [b.register_forward_pre_hook(pre(i)) for i, b in enumerate(m.layers)]
    handles += [b.register_forward_hook(post(i)) for i, b in enumerate(m.layers)]
    try:
        step(tok, cache)
    finally:
        for h in handles:
            h.remove()
    roles = defaultdict(list)
    for spec in m.plan:
        roles[spec.role].append(per_layer[spec.index])
    return dict(total=total, per_layer=total / len(m.layers),
                roles={r: statistics.mean(v) for r, v in roles.items()},
                outside_layers=total - sum(per_layer.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="v41_small")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--no-count", action="store_true", help="skip the kernel counts")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"of {', '.join(MODES)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    if any(x not in MODES for x in modes) or "static" not in modes:
        raise SystemExit(f"error: --modes takes {', '.join(MODES)} and must include static (got {args.modes})")
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/decode_kernels.py times CUDA graphs: it needs a CUDA device")
    dev = torch.device("cuda")
    m = build(args.model, dev)
    n = args.context

    def autocast():  # (without the cast-weight cache, as the graphs capture: a compiled step guards on that state)
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16", cache_enabled=False)

    print(f"decode on the kernels, {args.model}, context {n} per row, {args.precision}, "
          f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for B in sizes:
        t_start = time.perf_counter()
        print(f" batch {B}:")
        row = dict(model=args.model, context=n, batch=B, precision=args.precision,
                   device=torch.cuda.get_device_name(dev))
        max_len = n + 3 * args.steps + args.check_steps + 16
        row["check"] = check(m, B, n, args.check_steps, autocast,
                             [x for x in modes if x in ("kernels", "compiled", "compiled+kernels")] or ["kernels"],
                             max_len)
        times = defaultdict(list)
        with torch.no_grad(), autocast():
            for mode in modes:  # in turn, one graph alive at a time (two at once: decode_graph_check.py two-graphs)
                cache = filled(m, B, n, max_len)
                if mode in ("static", "kernels"):
                    step = (lambda f, c: lambda x: f(x, c))(step_fn(m, mode), cache)
                else:  # graph, graph+kernels, compiled, compiled+kernels: replayed from a CUDA graph
                    t0 = time.perf_counter()
                    step = _DecodeGraph(m, cache, step_fn(m, mode.replace("graph+", "").replace("graph", "static")))
                    print(f"  {mode}: warm-up and capture {time.perf_counter() - t0:.1f} s", flush=True)
                for i in range(2):
                    step(random_ids(m.cfg, B, 1, 4 + i, dev))
                if not args.no_count and B == sizes[0] and mode in ("static", "kernels", "compiled",
                                                                       "compiled+kernels"):
                    row[f"kernels_{mode}"] = k = kernels_by_role(m, step_fn(m, mode), random_ids(m.cfg, B, 1, 9, dev),
                                                                 cache, by_role=not mode.startswith("compiled"))
                    print(f"  kernels of one {mode} step: {k['total']} ({k['per_layer']:.1f} a layer; by role "
                          f"{', '.join(f'{r} {v:.1f}' for r, v in k['roles'].items())}; {k['outside_layers']} "
                          f"outside the layers)")
                for i in range(args.steps):
                    tok = random_ids(m.cfg, B, 1, 20 + i, dev)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(tok)
                    torch.cuda.synchronize()
                    times[mode].append(time.perf_counter() - t0)
                del step, cache
        med = {mode: statistics.median(v) for mode, v in times.items()}
        for mode in modes:
            print(f"  {mode:16s} {med[mode] * 1e3:8.2f} ms/step ({min(times[mode]) * 1e3:.2f}-"
                  f"{max(times[mode]) * 1e3:.2f}), {B / med[mode]:9.1f} tokens/s, {med['static'] / med[mode]:5.2f}x "
                  f"static")
        row["median_step_s"] = med
        print(f"  [batch {B}: {time.perf_counter() - t_start:.0f} s]", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"bench": "decode_kernels", **row}) + "\n")


if __name__ == "__main__":
    main()
