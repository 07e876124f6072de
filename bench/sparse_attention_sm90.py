"""What the sm_90 compiler makes of the sparse attention backward kernels, on any host (no GPU needed).

Compiles `bwd_probs`, `bwd_dq` and `bwd_dkv` for sm_90a at the flagship's tile (H=64, D=512) under each backward
setting that bench/kernel_cases/sparse_attention.py times, with the specialisation a real launch gets (16-byte
aligned pointers; T, E, K, the window and NW divisible by 16), and prints per kernel: shared memory, registers and
spill bytes (ptxas -v, the ptxas Triton bundles), the wgmma tile shapes, the global load / atomic widths and the
asynchronous copies. This is how the switches in kernels/sparse_attention.py were chosen before any timing; the
timing itself is `python3 bench/kernels.py --only sparse_attention/bwd` on the GPU.

Usage: python bench/sparse_attention_sm90.py [--few-heads]   (the second: v41_small's tile, H=16, D=256)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.sparse_attention as sa  # noqa: E402
import kernels.sparse_attention_bwd as bwd  # noqa: E402
from bench.kernel_cases.sparse_attention import _BWD_SWITCHES  # noqa: E402

_I32 = "i32"
_SIGNATURES = {
    bwd.bwd_probs: {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                    "dout_ptr": "*bf16", "lse_ptr": "*fp32", "p_ptr": "*bf16", "ds_ptr": "*bf16",
                    "dsink_ptr": "*fp32", "B": _I32, "T": _I32, "E": _I32, "K": _I32, "window": _I32, "NW": _I32,
                    "t0": _I32, "scale": "fp32", "qk_scale": "fp32"},
    bwd.bwd_dq: {"kv_ptr": "*bf16", "idx_ptr": "*i32", "ds_ptr": "*bf16", "dq_ptr": "*bf16", "B": _I32, "T": _I32,
                 "E": _I32, "K": _I32, "window": _I32, "NW": _I32, "t0": _I32},
    bwd.bwd_dkv: {"q_ptr": "*bf16", "dout_ptr": "*bf16", "idx_ptr": "*i32", "p_ptr": "*bf16", "ds_ptr": "*bf16",
                  "dkv_ptr": "*fp32", "B": _I32, "T": _I32, "E": _I32, "K": _I32, "window": _I32, "NW": _I32,
                  "t0": _I32, "n_q": _I32},
}
_DIV16 = {"T", "E", "K", "window", "NW"}  # 32768, 32768, 512, 128, 128 at the bench shape
_PTX_OPS = r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+|ld\.global(?:\.v\d)?\.b\d+|red\.global\.gpu\.relaxed\.add" \
           r"(?:\.v\d)?\.f32|cp\.async\.cg\.shared\.global"


def _constexprs(kernel, cfg: dict, H: int, D: int) -> dict:
    block_h, block_d = sa._tiles(H, D)
    out = dict(H=H, D=D, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=cfg["BLOCK_N"], PREC="tf32")
    if kernel is bwd.bwd_probs:
        out.update(STACKED=cfg["stacked_probs"], PROBS_N=cfg["probs_block_n"])
    if kernel is bwd.bwd_dkv:
        out.update(SPLIT_LOADS=cfg["split_loads"], PERSISTENT=cfg["dkv_overlap"])
    return out


def compile_report(kernel, cfg: dict, launch: str, H: int, D: int, workdir: str) -> str:
    signature = dict(_SIGNATURES[kernel])
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(signature.items())
             if v.startswith("*") or k in _DIV16}
    consts = _constexprs(kernel, cfg, H, D)
    signature.update({k: "constexpr" for k in consts})
    warps, stages = cfg[launch]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    ops = collections.Counter(re.findall(_PTX_OPS, ptx))
    regs = ""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    if ptxas.exists():  # the bundled ptxas that reads the PTX version Triton writes
        path = os.path.join(workdir, "k.ptx")
        Path(path).write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
        used = re.search(r"Used (\d+) registers", res.stderr)
        spill = re.search(r"(\d+) bytes spill stores", res.stderr)
        regs = f", {used.group(1) if used else '?'} registers, {spill.group(1) if spill else '?'} B spilled"
    return (f"{kernel.__name__:10s} {warps}w/{stages}s: {compiled.metadata.shared // 1024} KB shared{regs}; "
            + ", ".join(f"{n} {op}" for op, n in sorted(ops.items())))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--few-heads", action="store_true", help="v41_small's tile (H=16, D=256) and its config")
    args = ap.parse_args()
    H, D = (16, 256) if args.few_heads else (64, 512)
    base = sa.launch_config("bwd", sa._tiles(H, D)[0])
    settings = {"default": {}, **_BWD_SWITCHES}
    with tempfile.TemporaryDirectory() as workdir:
        for label, overrides in settings.items():
            cfg = {**base, **overrides}
            print(f"[{label}] {overrides or 'as shipped'}", flush=True)
            for kernel, launch in ((bwd.bwd_probs, "probs"), (bwd.bwd_dq, "dq"), (bwd.bwd_dkv, "dkv")):
                try:
                    print("  " + compile_report(kernel, cfg, launch, H, D, workdir), flush=True)
                except Exception as e:  # e.g. out of shared memory at this setting
                    print(f"  {kernel.__name__}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
