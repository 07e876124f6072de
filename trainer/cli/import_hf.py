"""`python -m trainer.cli.import_hf src=<HF dir> out=<dir>`: Hugging Face safetensors weights in the official
DeepSeek-V4.1-Flash layout as a Cedar checkpoint (`<out>/checkpoints/step_00000000`, weights only) for
`checkpoint.init_from=<out>`, streaming (trainer/checkpoint/hf_io.py; conf/import_hf.yaml lists the keys). The model
config comes from the directory's config.json (trainer/checkpoint/hf.py `model_config`). Under torchrun every rank reads and
writes its share of the tensors. Exit status 2 with one line on stderr for a bad key, a directory that is not a
DeepSeek-V4.1 checkpoint, a tensor of the wrong shape.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from config_checks import check_choices, choice_field, positive
from trainer.checkpoint.hf_io import hf_model_config, import_
from trainer.cli.app import join_world, run_app


@dataclass
class ImportConfig:
    src: str = ""
    """the HF directory: config.json and model.safetensors, or model-*.safetensors with their index"""
    out: str = ""
    """the directory to write; <out>/checkpoints/step_00000000 is the checkpoint"""
    chunk_mb: int = 256
    table_dtype: str = choice_field("", ("", "float32", "bfloat16"))
    """the Engram tables' storage dtype in the checkpoint (model.engram.table_dtype); "" = the files' (fp8 tables:
    bfloat16)"""

    def __post_init__(self) -> None:
        positive("import_hf.chunk_mb", self.chunk_mb)
        check_choices(self, "import_hf")
        for key in ("src", "out"):
            if not getattr(self, key):
                raise ValueError(f"{key}= is required: python -m trainer.cli.import_hf src=<HF dir> out=<dir>")


def import_checkpoint(cfg: ImportConfig) -> Path:
    src = Path(cfg.src)
    model_cfg = hf_model_config(src)
    if cfg.table_dtype:
        model_cfg = dataclasses.replace(model_cfg, engram=dataclasses.replace(model_cfg.engram,
                                                                              table_dtype=cfg.table_dtype))
    rank, world = join_world()
    t0 = time.perf_counter()
    path = import_(src, Path(cfg.out), model_cfg, chunk_bytes=cfg.chunk_mb * 2**20, rank=rank, world=world)
    if rank == 0:
        print(f"imported {src} -> {path} ({time.perf_counter() - t0:.1f} s); train from it with "
              f"checkpoint.init_from={cfg.out}")
    return path


def main(argv: list[str] | None = None) -> None:
    run_app("import_hf", ImportConfig, import_checkpoint, argv, __doc__)


if __name__ == "__main__":
    main()
