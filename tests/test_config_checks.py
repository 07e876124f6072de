"""The shared field checks (config_checks.py): each raises ValueError naming the full key and the bad value (NaN
included); a `choice_field` keeps its options in the field's metadata, which OmegaConf 2.3 structured configs
accept (defaults, merging, `to_object` running the check, Hydra's ConfigStore), and `options` reads them back. The
schemas use these options and no copies: every closed set of the job config is checked from its declaration."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from config_checks import at_least, check_choices, choice, choice_field, in_range, options, positive


@dataclass
class _Inner:
    mode: str = choice_field("a", ("a", "b"))
    """a closed set"""
    size: int = 1

    def __post_init__(self) -> None:
        check_choices(self, "outer.inner")
        positive("outer.inner.size", self.size)


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)


def test_messages_name_key_and_value():
    with pytest.raises(ValueError, match=r"^optim.schedule must be one of \['constant', 'cosine'\], got 'step'$"):
        choice("optim.schedule", "step", ("constant", "cosine"))
    with pytest.raises(ValueError, match=r"^trainer.max_steps must be >= 1, got 0$"):
        at_least("trainer.max_steps", 0, 1)
    with pytest.raises(ValueError, match=r"^data.seq_len must be > 0, got -3$"):
        positive("data.seq_len", -3)
    with pytest.raises(ValueError, match=r"^optim.min_lr_ratio must be in \[0, 1\], got 1.5$"):
        in_range("optim.min_lr_ratio", 1.5, 0, 1)
    with pytest.raises(ValueError, match=r"^k must be in \[0, 1\), got 1$"):
        in_range("k", 1, 0, 1, high_open=True)
    for check in (lambda v: positive("k", v), lambda v: at_least("k", v, 0), lambda v: in_range("k", v, 0, 1)):
        with pytest.raises(ValueError, match="got nan"):
            check(math.nan)
    choice("k", "a", ("a",)), at_least("k", 1, 1), positive("k", 1e-9), in_range("k", 1, 0, 1)  # bounds pass


def test_choice_field_in_omegaconf_structured_configs():
    from hydra.core.config_store import ConfigStore

    base = OmegaConf.structured(_Outer)
    assert base.inner.mode == "a"
    assert OmegaConf.to_object(OmegaConf.merge(base, {"inner": {"mode": "b"}})) == _Outer(_Inner(mode="b"))
    with pytest.raises(ValueError, match=r"outer.inner.mode must be one of \['a', 'b'\], got 'c'"):
        OmegaConf.to_object(OmegaConf.merge(base, {"inner": {"mode": "c"}}))
    ConfigStore.instance().store(name="_config_checks_test", node=_Outer)
    assert options(_Inner, "mode") == options(_Inner(), "mode") == ("a", "b")
    with pytest.raises(KeyError):
        options(_Inner, "size")


def _choice_fields(cls, prefix):
    """(key, options) of every choice_field reachable from dataclass `cls`, nested sections included."""
    out = []
    for f in dataclasses.fields(cls):
        if "choices" in f.metadata:
            out.append((f"{prefix}.{f.name}", f.metadata["choices"]))
        elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out += _choice_fields(f.default_factory, f"{prefix}.{f.name}")
    return out


def test_every_closed_set_of_the_job_config_is_checked_from_its_field():
    from trainer.config import Config

    fields = _choice_fields(Config, "cfg")
    keys = {k for k, _ in fields}
    assert {"cfg.model.kernels", "cfg.model.quant.swa_kv", "cfg.optim.schedule", "cfg.parallel.pp_schedule",
            "cfg.trainer.precision", "cfg.logger.wandb.mode", "cfg.stage.name"} <= keys
    for key, opts in fields:
        key = key.removeprefix("cfg.")
        node = OmegaConf.structured(Config)
        OmegaConf.update(node, key, "not-an-option")
        want = f"{key} must be one of {list(opts)}, got 'not-an-option'"
        with pytest.raises(ValueError, match="^" + re.escape(want)):
            OmegaConf.to_object(node)
