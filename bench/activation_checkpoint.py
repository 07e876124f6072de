"""Activation checkpointing (parallel.activation_checkpoint): what a training step keeps for the backward, and what
the recomputation costs, with and without it, measured through the trainer's code path (build_model -> parallelize
-> materialize, compute_gradients, AdamW, router-bias update) in one process.

Usage: .venv/bin/python bench/activation_checkpoint.py [--model v41_tiny] [--batch 8] [--seq 128] [--steps 5]
       [--device auto|cpu|cuda]

Per mode (none, full), one line:
- kept: the activation bytes one micro-batch holds between its forward and its backward, a device-independent count:
  the distinct storages of every tensor autograd saves outside a checkpointed block (saved_tensors_hooks; inside
  one, checkpoint's own hooks drop them), plus what each block is handed (streams, `pre`, and the ForwardState's
  tensors: compressed KV, top-k, pool, h_{L/2}), which a checkpointed block keeps instead; parameters and buffers
  excluded. With checkpointing the peak adds one block's activations while it is recomputed and differentiated.
- on CUDA also: kept as the allocator sees it (memory_allocated after the forward minus before) and the step's
  peak (max_memory_allocated, parameters, gradients and AdamW state included), one model alive at a time;
- step: median wall time of a training step (forward, backward with recomputation, clip, AdamW, bias update) over
  --steps steps after one warm-up step, and tokens/s; the two models' steps alternate, so a load that comes and
  goes on a shared machine slows both alike.
The tiny model on CPU runs fp32; on CUDA the trainer's default, bf16 autocast.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import load_config  # noqa: E402
from trainer.config import ParallelConfig, TrainerConfig  # noqa: E402
from trainer.parallel.gradients import update_router_biases  # noqa: E402
from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters  # noqa: E402

_MB = 2**20


def _tensors(obj):
    """The tensors in a block's arguments, the ForwardState's fields included."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            if not name.startswith("_"):  # the RoPE table cache: a few KB, held by the context either way
                yield from _tensors(getattr(obj, name))


def kept_bytes(module: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast) -> int:
    """One micro-batch's kept activation bytes (see the module docstring); runs its forward and backward."""
    weights = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    held: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, held so no storage is freed and reused meanwhile

    def note(t: torch.Tensor) -> None:
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                held.setdefault(ptr, t)

    def pack(t):
        note(t)
        return t

    def on_block(_, args):
        for t in _tensors(args):
            note(t)

    hooks = [layer.register_forward_pre_hook(on_block) for layer in module.layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            fwd = module(input_ids, outputs=True)
            logits, aux = fwd.logits, fwd.aux
        total = sum(t.untyped_storage().nbytes() for t in held.values())
    finally:
        for h in hooks:
            h.remove()
    held.clear()
    (F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) + sum(aux.values())).backward()
    module.zero_grad(set_to_none=True)
    return total


class Job:
    """One model (one activation_checkpoint mode) built through the trainer, its optimiser and a fixed batch."""

    def __init__(self, mode: str, model_name: str, batch: int, seq: int, device: str):
        parallel = ParallelConfig(activation_checkpoint=mode)
        self.rt = setup_runtime(TrainerConfig(device=device), parallel)
        cfg = load_config(model_name)
        self.pm = build_model(cfg, self.rt, parallel, 0, batch_size=batch, seq_len=seq, grad_accum=1)
        self.params = trainable_parameters(self.pm.module, cfg)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.dtype = self.rt.autocast_dtype
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, cfg.vocab_size, (batch, seq + 1), generator=g).to(self.rt.device)
        self.x, self.y = ids[:, :-1], ids[:, 1:]
        self.cuda = self.rt.device.type == "cuda"

    def autocast(self):
        return torch.autocast(self.rt.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None)

    def step(self) -> float:
        """One training step (forward, backward, clip, AdamW, bias update); its wall time."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        compute_gradients(self.pm, [{"input_ids": self.x, "labels": self.y}], self.params, 1.0, self.dtype)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        update_router_biases(self.pm)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def memory(self) -> dict:
        out = {"kept": kept_bytes(self.pm.module, self.x, self.y, self.autocast)}
        if self.cuda:
            self.step()  # optimiser state allocated
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            with self.autocast():
                fwd = self.pm.module(self.x, outputs=True)
                logits, aux = fwd.logits, fwd.aux
            out["kept_cuda"] = torch.cuda.memory_allocated() - before
            del logits, aux
            torch.cuda.reset_peak_memory_stats()
            self.step()
            out["peak_cuda"] = torch.cuda.max_memory_allocated()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v41_tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.model}, batch {args.batch} x seq {args.seq}, threads "
          f"{torch.get_num_threads()}")
    modes = ("none", "full")
    mem = {}
    for mode in modes:  # one model at a time, so the CUDA figures hold only its own tensors
        job = Job(mode, args.model, args.batch, args.seq, args.device)
        mem[mode] = job.memory()
        del job
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # Step times: both models, steps alternating, so a load that comes and goes (a shared machine) hits both alike.
    jobs = {mode: Job(mode, args.model, args.batch, args.seq, args.device) for mode in modes}
    times = {mode: [] for mode in modes}
    for i in range(args.steps + 1):  # one warm-up step each
        for mode in modes:
            t = jobs[mode].step()
            if i:
                times[mode].append(t)
    step = {mode: statistics.median(times[mode]) for mode in modes}
    for mode in modes:
        r = mem[mode]
        line = f"activation_checkpoint={mode:4s}  kept {r['kept'] / _MB:9.1f} MB"
        if "kept_cuda" in r:
            line += f"  (CUDA allocator {r['kept_cuda'] / _MB:9.1f} MB, step peak {r['peak_cuda'] / _MB:9.1f} MB)"
        line += f"  step {step[mode] * 1e3:8.1f} ms  {args.batch * args.seq / step[mode]:8.0f} tok/s"
        print(line)
    print(f"full / none: kept x{mem['full']['kept'] / mem['none']['kept']:.3f}, step time "
          f"x{step['full'] / step['none']:.2f}")


if __name__ == "__main__":
    main()
