"""Host memory and time of the Hugging Face export and import (trainer/checkpoint/hf_io.py), each in a fresh process.

    python bench/hf_io.py [--model v41_small] [--dtype bfloat16] [--chunk-mb 256] [--shard-gb 5] [--work DIR]

Builds the model of conf/model/<model>.yaml with its initial weights, saves it as a Cedar checkpoint, then runs in a
child process each: the export (checkpoint -> safetensors), and the import of what it wrote (safetensors -> a Cedar
checkpoint). Prints per step the wall time and the child's peak resident memory (VmHWM) above that of a child that
only imports the same modules, against the model's bytes and its largest tensor's; and the files' bytes against the
tensors'. The flagship plan (`--plan`): the pieces and files of v41_flash's export, from the config alone (meta).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_CHILD = r"""
import sys, time, json, torch
sys.path.insert(0, {root!r})
from tests.helpers import load_config
from trainer.checkpoint import hf_io as H
from pathlib import Path
step, cfg = {step!r}, load_config({model!r})
t = time.perf_counter()
if step == "export":
    H.export(Path({ckpt!r}), Path({out!r}), cfg, dtype=getattr(torch, {dtype!r}), max_shard_bytes={shard},
             chunk_bytes={chunk})
elif step == "import":
    from trainer.checkpoint.hf_io import hf_model_config
    H.import_(Path({out!r}), Path({imp!r}), hf_model_config(Path({out!r})), chunk_bytes={chunk})
wall = time.perf_counter() - t
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"wall": wall, "hwm_kb": int(hwm)}}))
"""


def _child(**kw) -> dict:
    """Run one step in a child process, sampling its anonymous resident memory (RssAnon: what it allocated, not the
    file pages it maps, which the kernel can drop) every 10 ms; its own VmHWM counts both."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT), **kw)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    anon = 0
    while proc.poll() is None:
        try:
            for line in open(f"/proc/{proc.pid}/status"):
                if line.startswith("RssAnon"):
                    anon = max(anon, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(err[-3000:])
    return {**json.loads(out.strip().splitlines()[-1]), "anon_kb": anon}


def plan(args) -> None:
    from tests.helpers import load_config
    from trainer.checkpoint import row_ranges
    from trainer.checkpoint.hf_io import export_plan

    cfg = load_config("v41_flash")
    shards = export_plan(cfg, getattr(torch, args.dtype), int(args.shard_gb * 1e9))
    entries = [e for s in shards for e in s]
    biggest = max(entries, key=lambda e: e.nbytes)
    pieces = sum(len(row_ranges(e.shape, 4, args.chunk_mb * 2**20)) for e in entries)
    print(f"v41_flash export ({args.dtype}): {len(entries):,} tensors, {sum(e.nbytes for e in entries) / 1e9:,.1f} GB "
          f"in {len(shards):,} files of <= {args.shard_gb} GB (a larger tensor alone); largest tensor {biggest.name} "
          f"{biggest.nbytes / 1e9:.1f} GB; {pieces:,} pieces of <= {args.chunk_mb} MiB (fp32 source): host memory "
          f"about two buffers of {args.chunk_mb} MiB (the pieces read and their casts) and one stored piece "
          f"(checkpoint.piece_mb), whatever the file or tensor size")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v41_small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--chunk-mb", type=int, default=256)
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--plan", action="store_true", help="print v41_flash's export plan (meta device) and stop")
    args = p.parse_args()
    if args.plan:
        return plan(args)
    from tests.helpers import load_config
    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    import model as model_pkg

    work = Path(args.work or tempfile.mkdtemp(prefix="hf_io_"))
    cfg = load_config(args.model)
    torch.manual_seed(0)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    state = m.state_dict()
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    largest = max(state.items(), key=lambda kv: kv[1].numel() * kv[1].element_size())
    t = time.perf_counter()
    ckpt = Checkpointer(work / "run" / "checkpoints", CheckpointConfig(), 0,
                        info={"model": dataclasses.asdict(cfg)}).save(1, {"train": {"model": state}})
    save_s = time.perf_counter() - t
    del m, state
    kw = dict(model=args.model, ckpt=str(ckpt), out=str(work / "hf"), imp=str(work / "imp"), dtype=args.dtype,
              shard=int(args.shard_gb * 1e9), chunk=args.chunk_mb * 2**20)
    base = _child(step="none", **kw)
    exp = _child(step="export", **kw)
    imp = _child(step="import", **kw)
    index = json.loads((work / "hf" / "model.safetensors.index.json").read_text())
    files = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
    gib = 2**30
    print(f"{args.model}: {model_bytes / gib:.2f} GiB of tensors (fp32 masters), largest {largest[0]} "
          f"{largest[1].numel() * largest[1].element_size() / gib:.3f} GiB; checkpoint saved in {save_s:.1f} s; "
          f"--chunk-mb {args.chunk_mb} --shard-gb {args.shard_gb} --dtype {args.dtype}")
    print(f"baseline child (imports only): peak {base['anon_kb'] / 2**20:.2f} GiB anonymous, "
          f"{base['hwm_kb'] / 2**20:.2f} GiB resident")
    for name, r in (("export", exp), ("import", imp)):
        print(f"{name}: {r['wall']:.1f} s; peak anonymous memory {r['anon_kb'] / 2**20:.2f} GiB "
              f"({(r['anon_kb'] - base['anon_kb']) / 2**20:.2f} GiB above the baseline); peak resident with mapped "
              f"file pages {r['hwm_kb'] / 2**20:.2f} GiB")
    print(f"export files: {files / 1e9:.3f} GB in {len(set(index['weight_map'].values()))} files; tensors "
          f"{index['metadata']['total_size'] / 1e9:.3f} GB (headers {files - index['metadata']['total_size']:,} bytes)")
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
