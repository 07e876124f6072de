"""`python -m trainer.cli.export_hf ckpt=<checkpoint or run dir> out=<dir> [dtype=bfloat16|float32] [quant=none|released]`: a Cedar checkpoint
(any parallel layout) as Hugging Face safetensors in the official DeepSeek-V4.1-Flash names, streaming
(trainer/checkpoint/hf_io.py; conf/export_hf.yaml lists the keys). Under torchrun every rank writes its share of the
files. Exit status 2 with one line on stderr for a bad key, a missing or corrupt checkpoint, a file it cannot write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config_checks import check_choices, choice_field, positive
from trainer.checkpoint.hf_io import export as export_files
from trainer.checkpoint.loading import find_checkpoint, model_config_from_dict, read_marker, run_tokenizer
from trainer.cli.app import join_world, run_app

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class ExportConfig:
    ckpt: str = ""
    """<run dir>/checkpoints/step_<N>, or a run directory (its newest complete checkpoint)"""
    out: str = ""
    """the directory to write"""
    dtype: str = choice_field("bfloat16", tuple(DTYPES))
    """bfloat16 (as released) or float32 (bit for bit); mHC parameters, sinks and router biases stay fp32"""
    quant: str = choice_field("none", ("none", "released"))
    """none: every tensor in `dtype`; released: the released checkpoints' quantised formats (routed experts FP4, the
    linear layers' other matrices FP8 in 128 x 128 blocks, Engram tables FP8; ue8m0 scales; trainer/checkpoint/hf_quant.py), the
    rest in `dtype`"""
    max_shard_gb: float = 5.0
    chunk_mb: int = 256
    tokenizer: str = ""
    """a tokenizer.json to copy beside the weights; "" = the training run's when it is known"""

    def __post_init__(self) -> None:
        check_choices(self, "export_hf")
        positive("export_hf.max_shard_gb", self.max_shard_gb)
        positive("export_hf.chunk_mb", self.chunk_mb)
        for key in ("ckpt", "out"):
            if not getattr(self, key):
                raise ValueError(f"{key}= is required: python -m trainer.cli.export_hf ckpt=<checkpoint or run dir> "
                                 "out=<dir>")


def export(cfg: ExportConfig) -> dict:
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():  # before any file is written
        raise ValueError(f"tokenizer={cfg.tokenizer!r} does not exist")
    path = find_checkpoint(cfg.ckpt)
    marker = read_marker(path)
    if "model" not in marker:
        raise ValueError(f"checkpoint {path} records no model config (format 1): it cannot be exported")
    model_cfg = model_config_from_dict(marker["model"], path)
    tokenizer = cfg.tokenizer
    if not tokenizer:
        try:
            tokenizer = run_tokenizer(path)
        except (ValueError, OSError):
            tokenizer = ""
    rank, world = join_world()
    t0 = time.perf_counter()
    index = export_files(path, Path(cfg.out), model_cfg, dtype=DTYPES[cfg.dtype],
                         max_shard_bytes=int(cfg.max_shard_gb * 1e9), chunk_bytes=cfg.chunk_mb * 2**20, rank=rank,
                         world=world, tokenizer=tokenizer or None, quant=cfg.quant)
    if world > 1:
        dist.barrier()
    if rank == 0:
        files = sorted(set(index["weight_map"].values()))
        print(f"exported {path} -> {cfg.out}: {len(index['weight_map'])} tensors, {len(files)} files, "
              f"{index['metadata']['total_size'] / 1e9:.3f} GB ({cfg.dtype}{', quantised as released' if cfg.quant == 'released' else ''}), {time.perf_counter() - t0:.1f} s"
              + (f"; tokenizer {tokenizer}" if tokenizer else ""))
    return index


def main(argv: list[str] | None = None) -> None:
    run_app("export_hf", ExportConfig, export, argv, __doc__)


if __name__ == "__main__":
    main()
