"""`python -m trainer.cli.plan [--world-size=N] [--json] model=<name> [parallel=<layout>] [overrides...]`: the memory and
communication plan of a job (trainer/memory_plan.py says what it counts). By default a table: the parameter counts,
the layout, the memory of each term per pipeline rank in GiB, the peak, whether it fits the device and the dominant
term; `--json` prints the whole plan as one JSON object instead (every figure, in bytes, and the assumptions). What the
trainer would refuse at start-up, and a mistyped config group option, is one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import json
import sys

from trainer.compose import compose
from trainer.memory_plan import plan

GIB = 2**30


def _split_flags(argv: list[str]) -> tuple[int | None, bool, list[str]]:
    """`--world-size=N` (or `--world-size N`) and `--json` out of the arguments; the rest are Hydra overrides."""
    world_size, as_json, rest, args = None, False, [], iter(argv)
    for a in args:
        if a == "--world-size" or a.startswith("--world-size="):
            value = a.partition("=")[2] if "=" in a else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--world-size takes a number of processes >= 1, got {value!r}")
            world_size = int(value)
        elif a == "--json":
            as_json = True
        else:
            rest.append(a)
    return world_size, as_json, rest


def _count(n: float) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _short(term: str) -> str:
    """`routed_experts (params + grads + optimiser state)` -> `routed_experts`."""
    return term.split(" (")[0]


def table(result: dict) -> str:
    """The plan (`trainer.memory_plan.plan`'s object) for a reader: counts, the layout, then per pipeline rank the
    memory of each term in GiB, the peak, whether it fits and the dominant term."""
    t, lay = result["training"], result["training"]["layout"]
    lines = [
        f"model {result['model']}: {_count(result['params_total'])} parameters (backbone "
        f"{_count(result['params_backbone'])}, Engram {_count(result['params_engram'])}); active per token: decode "
        f"{_count(result['params_active_decode'])}, prefill {_count(result['params_active_prefill'])}",
        f"KV cache {result['kv_bytes_per_token']:.0f} B/token; decode FLOPs/token {_count(result['decode_flops_per_token_4k'])}"
        f" at 4k context, {_count(result['decode_flops_per_token_1m'])} at 1M",
        f"layout: {lay['world_size']} process(es) = dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x tp "
        f"{lay['tp']} x pp {lay['pp']} x ep {lay['ep']} x cp {lay['cp']}; seq_len {lay['seq_len']}, batch_size "
        f"{lay['batch_size']}, grad_accum {lay['grad_accum']}; activation checkpointing {lay['activation_checkpoint']}",
        "",
    ]
    ranks = t["per_pp_rank"]
    terms = [("parameters", lambda r: sum(r["params_bytes"].values())),
             ("gradients", lambda r: sum(r["grads_bytes"].values())),
             ("optimizer state", lambda r: sum(r["optimizer_bytes"].values())),
             ("activations", lambda r: r["activations_bytes"]),
             ("working set", lambda r: r["working_set_bytes"]),
             ("optimizer step", lambda r: r["optimizer_step_transient_bytes"]),
             ("reserve", lambda r: r["reserve_bytes"]),
             ("peak", lambda r: r["peak_bytes"])]
    rows = [("memory per GPU, GiB", *[f"pp rank {r['pp_rank']}" for r in ranks])]
    rows += [(name, *[_gib(get(r)) for r in ranks]) for name, get in terms]
    rows.append(("dominant term", *[f"{_short(r['dominant']['term'])} {r['dominant']['share_of_peak']:.0%}"
                                     for r in ranks]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in rows]
    device = lay["device_memory_bytes"]
    lines += ["", f"{'fits' if t['fits'] else 'does NOT fit'}: peak {_gib(t['peak_bytes'])} GiB (pp rank "
                  f"{t['peak_pp_rank']}) of {_gib(device)} GiB per device (another: +parallel.device_memory_gb=<GB>); "
                  f"dominant term {t['dominant']['term']}",
              f"communication per rank and step: {_gib(t['communication_bytes_per_step_max']['total'])} GiB; every "
              "figure and the assumptions: --json"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    try:
        world_size, as_json, overrides = _split_flags(argv)
        result = plan(compose(overrides), world_size)
    except ValueError as e:  # the trainer's start-up errors and Hydra's, one line naming the key and the rule
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(json.dumps(result, indent=2) if as_json else table(result))


if __name__ == "__main__":
    main()
