"""Composing a config from the command line with Hydra, without its runner, and its mistakes as one line.

- `compose(overrides)`: the training job's config (conf/config.yaml), as `python -m trainer.cli.main` composes it;
  `compose_node(config_name, overrides)` any conf/<config_name>.yaml; `compose_app(config_name, schema, argv)` a small
  app's config as a validated `schema` instance.
- `check_config_groups(overrides)`: a mistyped config group option (`model=v41_tinny`, `parallel=nosuch`), which
  Hydra reports in a dozen lines (the options one a line, then its config search path) and, outside `@hydra.main`,
  as a traceback, checked on the command line before Hydra composes anything: ValueError naming the group and its
  options; for `@hydra.main` entry points, where Hydra reports the exception itself before our code runs.
- `missing_config_message(e)`, `one_line(e)`: Hydra's and OmegaConf's composition errors as one line.
- `hydra_overrides(argv)`, `sweep_variants(argv)`: the overrides of a `@hydra.main` command line, and of a `-m` sweep
  one plain list per value to try, composed before Hydra's runner.

The options are the group's configs in conf/ (and the ConfigStore), without the `schema` node every group
registers (trainer/config.py `register_configs`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

from trainer import CONF_DIR
from trainer.config import key_error_message, register_configs

_SCHEMA = "schema"


def unknown_option_message(group: str, value: str, options: Sequence[str]) -> str:
    """`model=v41_tinny: config group 'model' has no option 'v41_tinny' (did you mean v41_tiny?); options:
    v41_flash, v41_small, v41_tiny`."""
    shown = [o for o in options if o != _SCHEMA]
    close = difflib.get_close_matches(value, shown, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    listed = ", ".join(shown) if shown else "none"
    return f"{group}={value}: config group '{group}' has no option '{value}'{hint}; options: {listed}"


def missing_config_message(e: Exception) -> str:
    """One line for Hydra's MissingConfigException: the group option and the group's options when a group option
    is missing, else the first line of Hydra's message (a missing primary config)."""
    missing, options = getattr(e, "missing_cfg_file", None), getattr(e, "options", None)
    if missing and options is not None and "/" in missing:
        group, _, value = missing.rpartition("/")
        return unknown_option_message(group, value, options)
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _choices(override) -> list[str]:
    """The option names a group override selects: one, a list (`group=[a,b]`), or a choice sweep (`-m group=a,b`);
    none for a deletion, `null`, or a glob / range sweep (Hydra checks those)."""
    from hydra.core.override_parser.types import ValueType

    if override.is_delete():
        return []
    if override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return [str(v) for v in override.sweep_string_iterator()]
    if override.value_type != ValueType.ELEMENT:
        return []
    value = override.value()
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def check_config_groups(overrides: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """ValueError (one line: the group, its options) if an override selects a config group option that does not
    exist. Flags (`-m`, `--cfg job`) and overrides Hydra cannot parse are left to Hydra, which reports them."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates = [a for a in overrides if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except HydraException:
        return
    selections = [o for o in parsed if "." not in o.key_or_group and _choices(o)]
    if not selections:
        return
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        for o in selections:
            group = o.key_or_group
            parent, _, name = group.rpartition("/")
            if name not in loader.list_groups(parent):  # a plain key, or no such group: Hydra names it
                continue
            options = loader.get_group_options(group)
            for value in _choices(o):
                if value not in options:
                    raise ValueError(unknown_option_message(group, value, options))


# Hydra's own flags that take a value (`--cfg job`); the others (`--resolve`, `--help`, ...) stand alone.
_FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--info", "-i")
# Flags after which the overrides are not one config: a sweep, or another primary config.
_NOT_ONE_CONFIG = ("-m", "--multirun", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def hydra_overrides(argv: Sequence[str]) -> list[str] | None:
    """The overrides of a `@hydra.main` command line without Hydra's flags (`--cfg job`, `--resolve`), so they can be
    composed before Hydra's runner, which reports a bad one in a dozen lines; None for a multirun (`-m`: sweeps) or
    another primary config, left to the runner."""
    out, args = [], iter(argv)
    for a in args:
        flag = a.partition("=")[0]
        if flag in _NOT_ONE_CONFIG:
            return None
        if a.startswith("-"):
            if a in _FLAGS_WITH_VALUE and a not in ("--info", "-i"):
                next(args, None)
            continue
        out.append(a)
    return out


_PLAIN_VALUE = re.compile(r"^[\w.+\-/:@]*$")
_MULTIRUN = ("-m", "--multirun")


def sweep_variants(argv: Sequence[str]) -> list[list[str]] | None:
    """For a `-m` sweep (`optim.lr=1e-3,3e-3`, `range(...)`): lists of plain overrides that together take every value
    of every sweep override once (the other sweep overrides at their first value; the first and the last value of a
    long one), so that a misspelled key or a bad value is found in one line before Hydra's runner, which reports it
    in its own words and exit status 1. None when `argv` is no sweep, another primary config, or one whose values
    are left to Hydra (a glob, a value that would need quoting)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not any(a in _MULTIRUN for a in argv):
        return None
    overrides = hydra_overrides([a for a in argv if a not in _MULTIRUN])
    if overrides is None:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    firsts, sweeps = [], []  # the overrides in order, each sweep at its first value; (position, key, values)
    for o in parsed:
        if not o.is_sweep_override():
            firsts.append(o.input_line)
            continue
        if o.value_type.name == "GLOB_CHOICE_SWEEP":
            return None
        values = list(o.sweep_string_iterator())
        if not values or not all(_PLAIN_VALUE.match(v) for v in values):
            return None
        sweeps.append((len(firsts), o.get_key_element(), values if len(values) <= 8 else [values[0], values[-1]]))
        firsts.append(f"{o.get_key_element()}={values[0]}")
    variants = [firsts]
    for i, key, values in sweeps:
        variants += [firsts[:i] + [f"{key}={v}"] + firsts[i + 1:] for v in values[1:]]
    return variants


def one_line(e: Exception) -> str:
    """Any other Hydra or OmegaConf composition error in one line: a misspelled key with the closest valid key, a value
    of the wrong type with its key (trainer/config.py `key_error_message`); else its message and its cause's (Hydra's "Could not
    override 'x'." wraps OmegaConf's "Key 'x' not in 'Config'"), lines joined, without Hydra's HYDRA_FULL_ERROR hint
    and OmegaConf's object_type / reference_type trailers (the full key stays)."""
    for err in (e.__cause__, e):
        line = key_error_message(err) if err is not None else None
        if line:
            return line
    drop = ("Set the environment variable HYDRA_FULL_ERROR", "object_type=", "reference_type=")
    lines = []
    for err in (e, e.__cause__):
        if err is not None:
            lines += [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.strip().startswith(drop)]
    return " ".join(lines) if lines else type(e).__name__


def compose_app(config_name: str, schema, argv: Sequence[str]):
    """A small app's config: conf/<config_name>.yaml (whose defaults list starts with the schema registered as
    `<config_name>_schema`) with Hydra's override syntax from `argv`, as a validated `schema` instance; ValueError in
    one line (naming the key) for what Hydra, OmegaConf or the schema refuses."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name=f"{config_name}_schema", node=schema)
    check_config_groups(list(argv))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            node = compose(config_name=config_name, overrides=list(argv))
        plain = OmegaConf.to_container(node, resolve=True)
        plain.pop("hydra", None)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))
    except MissingConfigException as e:
        raise ValueError(missing_config_message(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(one_line(e)) from None


def compose_node(config_name: str, overrides: Sequence[str]):
    """conf/<config_name>.yaml with Hydra's override syntax (its schemas registered by the caller), as an OmegaConf
    node; ValueError (one line) for what Hydra refuses: a config group option that does not exist names the group
    and its options."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except MissingConfigException as e:
        raise ValueError(missing_config_message(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(one_line(e)) from None


def compose(overrides: Sequence[str]):
    """The training job's config with Hydra's override syntax, without starting a run (trainer/config.py
    `to_config` makes it typed); ValueError (one line) for what Hydra refuses."""
    register_configs()
    return compose_node("config", overrides)
