"""The compiled decode step (model.serving.compiled_decode_step) against the op-by-op one (model.serving.decode_step),
on caches prefilled with the same prompt and fed the same token stream, with the error of each measured against an
fp32 op-by-op reference: the check that decides whether a difference under bf16 autocast is rounding or a fault.

  python3 bench/compiled_decode.py [--model v41_tiny] [--precision fp32|bf16] [--batch 2] [--prompt-len 192]
                                   [--steps 8] [--graph] [--backend inductor] [--json OUT.jsonl]

Per step: max |logits - reference| of the op-by-op and of the compiled step, whether each one's argmax equals the
reference's, and the reference's top-2 margin where it does not. --graph also captures both steps in CUDA graphs
(trainer/engine/engine.py's _DecodeGraph, as Engine(cuda_graph=True) does), replays the same stream, compares the
replayed logits with the direct calls' and times a replay of each (median over --steps, CUDA only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generation import build, random_ids  # noqa: E402
from model.serving import compiled_decode_step, decode_step, serve_forward  # noqa: E402


def prefilled(m, prompt: torch.Tensor, max_len: int):
    cache = m.new_cache(prompt.shape[0], max_len, replay="none")
    serve_forward(m, prompt, cache)
    return cache


def stream(m, args, device) -> list[torch.Tensor]:
    """The decode inputs: fixed tokens, independent of any step's logits, so every path sees the same ones."""
    return [random_ids(m.cfg, args.batch, 1, 100 + i, device) for i in range(args.steps)]


def run_direct(m, step, prompt, toks, max_len, autocast: bool) -> list[torch.Tensor]:
    with torch.no_grad(), torch.autocast(prompt.device.type, dtype=torch.bfloat16, enabled=autocast):
        cache = prefilled(m, prompt, max_len)
        return [step(t, cache).float().clone() for t in toks]


def compare(name: str, ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    err = [float((g - r).abs().max()) for r, g in zip(ref, got)]
    top2 = [r.squeeze(1).topk(2, -1).values for r in ref]
    same = [bool((g.squeeze(1).argmax(-1) == r.squeeze(1).argmax(-1)).all()) for r, g in zip(ref, got)]
    margins = [float((v[:, 0] - v[:, 1]).min()) for v in top2]
    print(f"  {name:28s} max |d logits| per step {' '.join(f'{e:.2e}' for e in err)}")
    print(f"  {'':28s} argmax equal            {' '.join('yes' if s else f'NO(margin {mg:.2e})' for s, mg in zip(same, margins))}")
    return dict(path=name, max_abs=err, argmax_equal=same, ref_top2_margin=margins)


def replay_times(graph, toks, sync) -> tuple[list[torch.Tensor], float]:
    out, times = [], []
    for t in toks:
        sync()
        t0 = time.perf_counter()
        out.append(graph(t).float())
        sync()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times[1:] if len(times) > 2 else times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v41_tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--graph", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    m = build(args.model, dev)
    prompt = random_ids(m.cfg, args.batch, args.prompt_len, 1, dev)
    toks = stream(m, args, dev)
    max_len = args.prompt_len + args.steps + 16
    bf16 = args.precision == "bf16"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"compiled decode check: {args.model}, batch {args.batch}, prompt {args.prompt_len}, {args.steps} steps, "
          f"{args.precision}, backend {args.backend}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    ref = run_direct(m, lambda t, c: decode_step(m, t, c), prompt, toks, max_len, autocast=False)
    rows = []
    if bf16:
        eager = run_direct(m, lambda t, c: decode_step(m, t, c), prompt, toks, max_len, autocast=True)
        rows.append(compare("op by op, bf16", ref, eager))
    compiled = compiled_decode_step(m, args.backend)
    t0 = time.perf_counter()
    got = run_direct(m, compiled, prompt, toks, max_len, autocast=bf16)
    print(f"  compiled: first {args.steps} steps incl. compiling {time.perf_counter() - t0:.1f} s")
    rows.append(compare(f"compiled, {args.precision}", ref, got))
    if args.graph:
        from trainer.engine.engine import _DecodeGraph

        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            for name, step in (("graph op by op", None), ("graph compiled", compiled)):
                cache = prefilled(m, prompt, max_len)
                g = _DecodeGraph(m, cache, step)
                out, med = replay_times(g, toks, sync)
                row = compare(f"{name}, {args.precision}", ref, out)
                row["replay_ms"] = med * 1e3
                print(f"  {'':28s} replay {med * 1e3:.3f} ms a step")
                rows.append(row)
                del g, cache
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(bench="compiled_decode", model=args.model, precision=args.precision,
                                        batch=args.batch, prompt_len=args.prompt_len, **r)) + "\n")


if __name__ == "__main__":
    main()
