"""Loading a training checkpoint, saved under any parallel layout, into one process for generation.

- `find_checkpoint`: a checkpoint directory (`<run dir>/checkpoints/step_<N>`), or a run directory (or its
  `checkpoints/`): its newest complete checkpoint; `read_marker` checks it is intact (trainer/checkpoint/checkpointer.py `verify`).
- `model_config`: the config the checkpoint records (what was trained, stage hooks applied), with `model.<key>=`
  overrides or a chosen config that may change only what changes no parameter (the cache's formats, the kernels).
- `run_tokenizer`: the tokenizer the run trained with (its `.hydra/config.yaml`).
- `load_model`: the checkpoint's `train.model` entry (weights and MoE balancing biases under the whole model's names,
  which every layout saves) read with DCP into a single-process model; not the optimiser.
Each refusal is a ValueError of one line naming the file or the key.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch

import model as model_pkg
from data.shards import file_sha256
from model.config import ModelConfig
from trainer.canonical_vocab import install_canonical_vocab
from trainer.checkpoint import (
    COMPLETE_MARKER,
    Checkpointer,
    complete_checkpoints,
    is_complete,
    model_config_differences,
    verify,
)
from trainer.compose import one_line

__all__ = ["find_checkpoint", "read_marker", "model_config", "run_tokenizer", "load_model", "read_model_state"]


# -- the checkpoint and its model config -------------------------------------------------------------------------------
def find_checkpoint(ckpt: str) -> Path:
    """The checkpoint `ckpt` names: itself, or the newest complete one of a run directory (or of its checkpoints/)."""
    path = Path(ckpt)
    if not path.is_dir():
        raise ValueError(f"ckpt={ckpt!r} {'is not a directory' if path.exists() else 'does not exist'}")
    if is_complete(path):
        return path
    if re.match(r"^(\.tmp_)?step_\d+$", path.name):
        raise ValueError(f"ckpt={ckpt!r} is not a complete checkpoint: it has no {COMPLETE_MARKER} marker (a save that "
                         "did not finish); give a complete one, or the run directory for its newest")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = complete_checkpoints(root)
    if found:
        return found[-1]
    if root is path and not any(p.name.startswith(("step_", ".tmp_step_")) for p in path.iterdir()):
        raise ValueError(f"ckpt={ckpt!r} is neither a checkpoint directory (step_<N> with a {COMPLETE_MARKER} marker) "
                         "nor a run directory (with checkpoints/)")
    raise ValueError(f"ckpt={ckpt!r}: {root} holds no complete checkpoint (no step_<N> with a {COMPLETE_MARKER} "
                     "marker: every save there was interrupted)")


def read_marker(path: Path) -> dict:
    """The checkpoint's marker, checked: every file it lists is there, with its size and sha256."""
    try:
        marker = Checkpointer.marker(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: its {COMPLETE_MARKER} marker cannot be read ({e})") from None
    problems = verify(path)
    if problems:
        older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
        hint = f"; an older one: ckpt={older[-1]}" if older else ""
        raise ValueError(f"checkpoint {path} is corrupt: {'; '.join(problems)}{hint}")
    return marker


def model_config_from_dict(saved: dict, path: Path) -> ModelConfig:
    """The ModelConfig a checkpoint's marker records (`saved`, a dict); ValueError naming `path` if this version
    cannot read it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))
    except OmegaConfBaseException as e:
        raise ValueError(f"checkpoint {path} records a model config this version cannot read: "
                         f"{str(e).splitlines()[0]}") from None


def _with_overrides(cfg: ModelConfig, overrides: list[str]) -> ModelConfig:
    """`cfg` with `model.<key>=<value>` overrides (Hydra's syntax) applied; ValueError naming a bad one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(cfg)  # typed: a misspelled key or a value of the wrong type fails, named
    for line in overrides:
        try:
            (o,) = OverridesParser.create().parse_overrides([line])
            if o.is_sweep_override() or o.is_delete():
                raise ValueError(f"{line}: only model.<key>=<value> overrides apply to the checkpoint's config")
            OmegaConf.update(node, o.key_or_group[len("model."):], o.value(), merge=True)
        except (HydraException, OmegaConfBaseException) as e:
            raise ValueError(f"{line}: {one_line(e)}") from None
    return OmegaConf.to_object(node)


def model_config(saved: dict | None, chosen: ModelConfig | None, overrides: list[str], path: Path) -> ModelConfig:
    """The config to build: the checkpoint's (`saved`) with `overrides` on top, or `chosen` (`model=<option>`, composed
    by Hydra) instead. ValueError when either changes a parameter, or when the checkpoint records none and no
    option is chosen."""
    if saved is None:
        if chosen is None:
            raise ValueError(f"checkpoint {path} records no model config (saved before format 2): give the one it was "
                             "trained with, model=<option> [model.<key>=<value> ...]")
        return chosen
    cfg = chosen if chosen is not None else _with_overrides(model_config_from_dict(saved, path), overrides)
    diff = model_config_differences(saved, dataclasses.asdict(cfg))
    if diff:
        shown = "; ".join(f"model.{k}={a!r} there, {b!r} here" for k, a, b in diff)
        raise ValueError(f"checkpoint {path} was saved with another model: {shown}. Leave model out (the checkpoint's "
                         "config is used): only keys that change no parameter (kernels, quantisation) may be set")
    return cfg


# -- the tokenizer -----------------------------------------------------------------------------------------------------
def run_tokenizer(ckpt: Path) -> str:
    """The tokenizer of the training run that saved `ckpt` (<run dir>/checkpoints/step_<N>), from its Hydra config:
    data.tokenizer, or the tokenizer.json that data.path's shards were made with (their meta.json's sha256)."""
    from omegaconf import OmegaConf

    run_dir = ckpt.parent.parent
    config = run_dir / ".hydra" / "config.yaml"
    hint = "give tokenizer=<the tokenizer.json the run trained with>"
    if ckpt.parent.name != "checkpoints" or not config.is_file():
        raise ValueError(f"checkpoint {ckpt} is not in a run directory with .hydra/config.yaml to find its tokenizer "
                         f"from: {hint}")
    try:
        data = OmegaConf.load(config).data
        path, tokenizer = str(data.path), str(data.tokenizer or "")
        launch_dir = Path(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.cwd)
    except Exception as e:  # a hand-edited or older config: OmegaConf raises several kinds
        raise ValueError(f"cannot read the run's data settings from {config} ({e}): {hint}") from None
    if tokenizer:  # relative paths are the launch directory's, as in training
        found = launch_dir / tokenizer
        if not found.is_file():
            raise ValueError(f"the run's data.tokenizer={tokenizer!r} ({found}) does not exist: {hint}")
        return str(found)
    shards = launch_dir / path
    try:
        meta = json.loads((shards / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"the run's data.path={path!r}: cannot read {shards / 'meta.json'} ({e}): {hint}") from None
    found = shards / meta.get("tokenizer", "tokenizer.json")
    if not found.is_file() or ("tokenizer_sha256" in meta and file_sha256(found) != meta["tokenizer_sha256"]):
        raise ValueError(f"{found} is missing or not the tokenizer the run's shards were made with: {hint}")
    return str(found)


# -- the model ---------------------------------------------------------------------------------------------------------
def load_model(path: Path, cfg: ModelConfig, device: torch.device, tokenizer_path: str) -> torch.nn.Module:
    """The whole model in this process, in eval mode, holding the checkpoint's weights and balancing biases whatever
    layout saved them (the checkpoint's `train.model` entry, read with DCP; the optimiser state is not read)."""
    with torch.device("meta"):
        model = model_pkg.build(cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # the buffers no checkpoint holds (Engram's hash constants, MoE load counters)
    install_canonical_vocab(model, cfg, tokenizer_path)
    read_model_state(path, model, f"the parameters of model {cfg.name!r} as configured")
    return model.eval()


def read_model_state(path: Path, module: torch.nn.Module, what: str) -> None:
    """Checkpoint `path`'s `train.model` entry (whatever layout saved it) into `module`, in this process. what: the
    error's words for what the checkpoint should hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(module)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            # no_dist: this process reads every piece itself, also when launched inside a process group
            dcp.load({"train": {"model": state}}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"checkpoint {path} does not hold {what}: {_cause(e)}") from None
    set_model_state_dict(module, state)


def _cause(e: BaseException) -> str:
    """The first line of what failed: a DCP CheckpointException carries each rank's exception."""
    failures = getattr(e, "failures", None)
    if failures:
        failure = next(iter(failures.values()))
        e = failure[0] if isinstance(failure, tuple) else failure
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


