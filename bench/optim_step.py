"""The optimiser step alone, by implementation: torch AdamW fused, foreach and for_loop (optim.impl), and optim=muon
(conf/optim/muon.yaml: Muon, head-wise Muon, Sinkhorn momentum and fused AdamW by rules), over the parameters of a
model config, on random gradients (every table row touched: Sinkhorn's worst case); the wall time per step and its
ratio to the first. With --fwd-bwd B,T, also the forward + backward of one B x T batch of the same model (bf16
autocast on CUDA), the step that the optimiser's time is compared with.

    python bench/optim_step.py [--model v41_tiny] [--impls fused,foreach,for_loop,muon] [--steps 10]
        [--device cpu|cuda] [--fwd-bwd 8,128]

The model is built as the trainer builds it for one process (meta, then materialised and initialised), so the
parameter list, its groups (decayed or not) and the kinds the step splits by are the trainer's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v41_tiny")
    p.add_argument("--impls", default="fused,foreach,for_loop")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fwd-bwd", default="", help="B,T: also time forward + backward of a B x T batch")
    args = p.parse_args()
    from omegaconf import OmegaConf

    import model as model_pkg
    from model.config import ModelConfig
    from optim.builder import build_optimizer
    from optim.config import OptimConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    y = OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")
    y.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device=args.device)
    m.init_weights()
    params = [q for q in m.parameters() if q.requires_grad]
    gen = torch.Generator(device=args.device).manual_seed(0)
    for q in params:
        q.grad = torch.randn(q.shape, device=args.device, generator=gen) * 1e-3
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    n = sum(q.numel() for q in params)
    print(f"{args.model}: {len(params)} parameters, {n / 1e6:.1f} M values, device {args.device}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows = []
    muon_cfg = OmegaConf.load(ROOT / "conf" / "optim" / "muon.yaml")
    muon_cfg.pop("defaults", None)
    muon_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), muon_cfg))
    from model.attention import head_rows

    for impl in args.impls.split(","):
        if impl == "muon":
            opt = build_optimizer(params, muon_cfg, named=m.named_parameters(), head_rows=head_rows(cfg))
        else:
            opt = build_optimizer(params, OptimConfig(impl=impl, warmup_steps=0))
        for _ in range(args.warmup):
            opt.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        rows.append((impl, ms))
        del opt
    fb = _fwd_bwd(m, cfg, args) if args.fwd_bwd else None
    print(f"{'impl':10s} {'ms/step':>9s} {'vs ' + rows[0][0]:>12s} {'GB/s (28 B/value)':>18s}"
          + (f" {'vs fwd+bwd':>11s}" if fb else ""))
    for impl, ms in rows:
        print(f"{impl:10s} {ms:9.2f} {ms / rows[0][1]:11.2f}x {28 * n / ms / 1e6:18.1f}"
              + (f" {ms / fb:10.3f}x" if fb else ""))
    if fb:
        print(f"forward + backward of {args.fwd_bwd.replace(',', ' x ')} tokens: {fb:.2f} ms")


def _fwd_bwd(m, cfg, args) -> float:
    """ms of one forward + backward (cross-entropy on random tokens), the median of --steps after --warmup."""
    import statistics

    B, T = (int(x) for x in args.fwd_bwd.split(","))
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device=args.device)
    cuda = args.device == "cuda"
    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            logits = m(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
