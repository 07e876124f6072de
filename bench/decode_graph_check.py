"""Which decode step fails in a CUDA graph, and where (issue 40: session 23's device-side assert while replaying the
decode benchmark's graphs at v41_small, 4K context): one step, the reference or the serving kernels, on a cache
filled by a real 512-token prefill or by bench/generation.py's synthetic fill.

    python3 bench/decode_graph_check.py FILL STEP [--phase eager|graph] [--steps 8] [--model v41_small]
        FILL: prefill | synthetic; STEP: reference | kernels

--phase eager: the step run op by op --steps times, synchronised after each (with CUDA_LAUNCH_BLOCKING=1 a failing
operation's traceback names it). --phase graph: the warm-up and capture of trainer/engine/engine.py's _DecodeGraph,
synchronised, then --steps replays, each synchronised and its logits compared with the same step run op by op on a
twin cache fed the same tokens (a replay that reads state the capture froze drifts from its twin). --phase
two-graphs: two replays of the first graph, then a second graph (--second's step) captured on a cache of its own,
and the two replayed in turn (session 21 saw an index assert replaying a graph after a second was captured).

A line per stage, flushed; a device-side assert poisons the CUDA context, so each (fill, step, phase) runs in its own
process.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import build, random_ids, synthetic_fill  # noqa: E402
from model.serving import decode_step  # noqa: E402
from trainer.engine.engine import _DecodeGraph  # noqa: E402


def replay(cfg, tag, stage, graph, step, cache, twin, seed) -> None:
    """One replay, synchronised, and its logits against the same step op by op on the twin cache."""
    ids = random_ids(cfg, 1, 1, seed, cache.lengths.device)
    out = graph(ids)
    torch.cuda.synchronize()
    ref = step(ids, twin)
    torch.cuda.synchronize()
    d = (out.float() - ref.float()).abs().max().item()
    print(f"{tag}: {stage} ok, length {int(cache.lengths[0])} (twin {int(twin.lengths[0])}), max |d logits| vs op "
          f"by op {d:.3e}, argmax equal {bool((out.argmax(-1) == ref.argmax(-1)).all())}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fill", choices=("prefill", "synthetic"))
    p.add_argument("step", choices=("reference", "kernels"))
    p.add_argument("--phase", choices=("eager", "graph", "two-graphs"), default="graph")
    p.add_argument("--second", choices=("reference", "kernels"), default="kernels",
                   help="two-graphs: the second graph's step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default="v41_small")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/decode_graph_check.py captures CUDA graphs: it needs a CUDA device")
    dev = torch.device("cuda")
    tag = f"{args.phase} {args.step} fill {args.fill}"
    m = build(args.model, dev)
    kern = args.step == "kernels"
    step = functools.partial(decode_step, m, kernels="triton" if kern else "reference")
    n = 4096 if args.fill == "synthetic" else 512

    def filled():
        cache = m.new_cache(1, n + args.steps + 64, replay="none")
        if args.fill == "synthetic":
            synthetic_fill(m, cache, n, 3)
        else:
            m(random_ids(m.cfg, 1, n, 7, dev), cache=cache)
        return cache

    stage = "fill"
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            cache = filled()
            torch.cuda.synchronize()
            print(f"{tag}: filled to {n}", flush=True)
            if args.phase == "eager":
                for i in range(args.steps):
                    stage = f"eager step {i + 1}"
                    step(random_ids(m.cfg, 1, 1, 20 + i, dev), cache)
                    torch.cuda.synchronize()
                    print(f"{tag}: {stage} ok, length {int(cache.lengths[0])}", flush=True)
            else:
                twin = filled()
                stage = "warm-up and capture"
                graph = _DecodeGraph(m, cache, None if not kern else step)
                torch.cuda.synchronize()
                print(f"{tag}: {stage} ok", flush=True)
                first = args.steps if args.phase == "graph" else 2
                for i in range(first):
                    stage = f"replay {i + 1}"
                    replay(m.cfg, tag, stage, graph, step, cache, twin, 20 + i)
                if args.phase == "two-graphs":
                    step2 = functools.partial(decode_step, m, kernels="triton" if args.second == "kernels"
                                              else "reference")
                    cache2, twin2 = filled(), filled()
                    stage = f"second graph ({args.second}): warm-up and capture"
                    graph2 = _DecodeGraph(m, cache2, step2 if args.second == "kernels" else None)
                    torch.cuda.synchronize()
                    print(f"{tag}: {stage} ok", flush=True)
                    for i in range(first, args.steps):
                        stage = f"first graph, replay {i + 1}"
                        replay(m.cfg, tag, stage, graph, step, cache, twin, 20 + i)
                        stage = f"second graph, replay {i + 1 - first}"
                        replay(m.cfg, tag, stage, graph2, step2, cache2, twin2, 40 + i)
    except Exception as e:  # noqa: BLE001 (the line is the result)
        print(f"{tag}: {stage} FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        traceback.print_exc(limit=-6)
        sys.exit(1)
    print(f"{tag}: all {args.steps} ok")


if __name__ == "__main__":
    main()
