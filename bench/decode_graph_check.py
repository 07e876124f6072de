"""Which decode step fails in a CUDA graph (issue 40: session 23's device-side assert while replaying the decode
benchmark's graphs at v41_small, 4K context): one step, the reference or the serving kernels, captured on a cache
filled by a real 512-token prefill or by bench/generation.py's synthetic fill, replayed three times.

    python3 bench/decode_graph_check.py FILL STEP [--model v41_small]    FILL: prefill | synthetic; STEP: reference |
                                                                          kernels

One line; a device-side assert poisons the CUDA context, so each (fill, step) pair runs in its own process.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import build, random_ids, synthetic_fill  # noqa: E402
from model.serving import decode_step  # noqa: E402
from trainer.engine.engine import _DecodeGraph  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fill", choices=("prefill", "synthetic"))
    p.add_argument("step", choices=("reference", "kernels"))
    p.add_argument("--model", default="v41_small")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/decode_graph_check.py captures CUDA graphs: it needs a CUDA device")
    dev = torch.device("cuda")
    m = build(args.model, dev)
    step = None if args.step == "reference" else functools.partial(decode_step, m, kernels="triton")
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            cache = m.new_cache(1, 4096 + 64, replay="none")
            if args.fill == "synthetic":
                synthetic_fill(m, cache, 4096, 3)
            else:
                m(random_ids(m.cfg, 1, 512, 7, dev), cache=cache)
            graph = _DecodeGraph(m, cache, step)
            for i in range(3):
                graph(random_ids(m.cfg, 1, 1, 20 + i, dev))
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (the one line is the result)
        print(f"graph {args.step} fill {args.fill}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}")
        sys.exit(1)
    print(f"graph {args.step} fill {args.fill}: 3 replays ok")


if __name__ == "__main__":
    main()
