"""Benchmark cases: the Triton top-k (kernels/topk.py, default variant: "resident" at these row lengths) vs
torch.topk(sorted=False) on the same fp32 input.

- topk/select_512_of_32k: the indexer's top-512 at 128K context and ratio 4: R = 4096 query rows of N = 32768
  compressed entries.
- topk/pool_2048_of_16k: the candidate pool's top-2048 blocks of 8 at 128K context and ratio 1: N = 16384 block
  scores per row.
Inputs are standard normal (no ties, every entry visible). Bytes: the scores read once (4 R N) plus the values and
the int32 indices written (8 R K); the resident kernel reads each row once, the radix one (passes + 1) times, mostly
from L2. `sweep=True` adds the resident kernel at 4 / 8 / 16 warps and the radix kernel's chunk size / radix width /
warp variants (<= 22 cases).
"""

from __future__ import annotations

import torch

from kernels import topk as tk

ROWS, N_SELECT, K_SELECT, N_POOL, K_POOL = 4096, 32768, 512, 16384, 2048
DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it

# (BLOCK_N, RADIX_BITS, num_warps) variants: the chunk, the radix width (8: 4 select passes, 11 and 12: 3,
# 6: 6, 5: 7) and the warps.
_SWEEP_SELECT = ((1024, 8, 4), (1024, 8, 8), (4096, 8, 8), (4096, 8, 16), (2048, 8, 16), (2048, 6, 8), (2048, 5, 8),
                 (2048, 11, 8), (1024, 11, 4), (2048, 12, 8))
_SWEEP_POOL = ((1024, 8, 4), (4096, 8, 16), (2048, 6, 8), (2048, 11, 8))
_SWEEP_RESIDENT_WARPS = (4, 8, 16)  # 32768 fp32 keys: 256, 128 and 64 registers of keys a thread


def _case(name, fn_triton, fn_baseline, num_bytes, sweep=False):
    return {"name": name, "fn_triton": fn_triton, "fn_baseline": fn_baseline, "bytes": num_bytes, "sweep": sweep}


def cases(sweep: bool = False) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    out = []
    for label, n, k, variants in (("select_512_of_32k", N_SELECT, K_SELECT, _SWEEP_SELECT),
                                  ("pool_2048_of_16k", N_POOL, K_POOL, _SWEEP_POOL)):
        x = torch.randn(ROWS, n, device=DEVICE, generator=g)
        num_bytes = 4 * ROWS * n + 8 * ROWS * k
        out.append(_case(f"topk/{label}", lambda x=x, k=k: tk.topk(x, k, impl="triton"),
                         lambda x=x, k=k: x.topk(k, dim=-1, sorted=False), num_bytes))
        if sweep:
            for warps in _SWEEP_RESIDENT_WARPS:
                out.append(_case(f"topk/{label}/resident,num_warps={warps}",
                                 lambda x=x, k=k, w=warps: tk.topk(x, k, impl="triton", variant="resident",
                                                                   num_warps=w),
                                 lambda: None, num_bytes, sweep=True))
            for bn, bits, warps in variants:
                out.append(_case(f"topk/{label}/BLOCK_N={bn},RADIX_BITS={bits},num_warps={warps}",
                                 lambda x=x, k=k, bn=bn, bits=bits, w=warps: tk.topk(
                                     x, k, impl="triton", variant="radix", block_n=bn, radix_bits=bits,
                                     num_warps=w),
                                 lambda: None, num_bytes, sweep=True))
    return out
