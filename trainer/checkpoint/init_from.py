"""checkpoint.init_from: another run's weights (a checkpoint of any layout, or a Hugging Face directory imported
first) as a run's starting point (trainer/train.py `build` calls `init_weights_from`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import torch

from model.config import ModelConfig
from trainer.checkpoint import Checkpointer, model_config_differences, rank_and_world
from trainer.checkpoint.hf_io import hf_model_config, import_, is_hf_dir
from trainer.checkpoint.loading import find_checkpoint, read_marker
from trainer.parallel.apply import ParallelModel

log = logging.getLogger(__name__)

__all__ = ["init_weights_from"]


def init_weights_from(ckpt: str, pm: ParallelModel, optimizer: torch.optim.Optimizer | None, model_cfg: ModelConfig,
                      checkpointer: Checkpointer) -> Path:
    """Load another run's weights (and, with `optimizer`, its optimiser moments) into this rank's part of the model,
    whatever layout saved them (DCP reshards): checkpoint.init_from. The step count and schedule stay at 0.
    A Hugging Face directory (config.json + safetensors) is first imported, streaming, as a checkpoint beside the
    run's own (`<run dir>/hf_init/`, trainer/checkpoint/hf_io.py), by every rank its share; its config.json must give
    the run's model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    if is_hf_dir(Path(ckpt)):
        ckpt = str(_import_hf_init(Path(ckpt), pm, optimizer, model_cfg, checkpointer))
    try:
        path = find_checkpoint(ckpt)
        marker = read_marker(path)  # every file there, with its checksum
    except ValueError as e:
        raise ValueError(f"checkpoint.init_from: {e}".replace("ckpt=", "")) from None
    try:
        checkpointer.check_model(path, _stored_as(marker.get("model"), model_cfg, path))
    except ValueError as e:
        raise ValueError(f"checkpoint.init_from: {str(e).split('. Resume with')[0]}") from None
    state = {"model": get_model_state_dict(pm.module)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(pm.module, optimizer)
    with contextlib.ExitStack() as stack:
        import warnings

        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load({"train": state}, storage_reader=FileSystemReader(str(path)))
    set_model_state_dict(pm.module, state["model"])
    if optimizer is not None:
        live = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        set_optimizer_state_dict(pm.module, optimizer, state["optim"])
        for group, values in zip(optimizer.param_groups, live):  # the config's hyperparameters, as on resume
            group.update(values)
    log.info("initialised from %s%s", path, " (weights and optimiser moments)" if optimizer is not None else "")
    return path


def _stored_as(saved: dict | None, model_cfg: ModelConfig, path: Path) -> ModelConfig:
    """`model_cfg` with the storage dtypes of checkpoint `path` (its marker's model config `saved`): a checkpoint
    whose Engram tables are stored in another dtype (an imported bf16 checkpoint, a float32 run) is loaded into this
    run's tables, cast by the load (one info line says so); every other difference is still refused."""
    saved_dtype = ((saved or {}).get("engram") or {}).get("table_dtype")
    if saved_dtype is None or saved_dtype == model_cfg.engram.table_dtype:
        return model_cfg
    log.info("checkpoint.init_from: %s stores the Engram tables in %s; cast to this run's "
             "model.engram.table_dtype=%s", path, saved_dtype, model_cfg.engram.table_dtype)
    return dataclasses.replace(model_cfg, engram=dataclasses.replace(model_cfg.engram, table_dtype=saved_dtype))


def _import_hf_init(src: Path, pm: ParallelModel, optimizer, model_cfg: ModelConfig,
                    checkpointer: Checkpointer) -> Path:
    """checkpoint.init_from=<Hugging Face directory>: its weights as a checkpoint under `<run dir>/hf_init/`."""
    if optimizer is not None:
        raise ValueError(f"checkpoint.init_from={src} is a Hugging Face directory: it holds no optimiser state, so "
                         "checkpoint.init_optimizer=true cannot apply; set checkpoint.init_optimizer=false")
    hf_cfg = hf_model_config(src)
    # the tables' storage dtype is the run's choice: the file's values are cast to it
    hf_cfg = dataclasses.replace(hf_cfg, engram=dataclasses.replace(hf_cfg.engram,
                                                                    table_dtype=model_cfg.engram.table_dtype))
    diff = model_config_differences(dataclasses.asdict(hf_cfg), dataclasses.asdict(model_cfg))
    if diff:
        shown = "; ".join(f"model.{k}={a!r} there, {b!r} here" for k, a, b in diff[:8])
        raise ValueError(f"checkpoint.init_from={src}: its config.json gives another model: {shown}"
                         + (f" (and {len(diff) - 8} more)" if len(diff) > 8 else ""))
    rank, world = rank_and_world()
    out = checkpointer.root.parent / "hf_init"
    path = import_(src, out, hf_cfg, rank=rank, world=world)
    log.info("checkpoint.init_from: imported the Hugging Face weights of %s as %s", src, path)
    return path
