"""Field checks shared by the config schemas (model/, data/, optim/ and trainer/ `config.py`).

Each check raises ValueError naming the full key (`optim.schedule`, `model.attention.num_heads`, ...) and the bad
value, in one wording for every section. This module imports only the standard library, so every schema can use it
without an import cycle and `python -m data.prepare` stays free of torch.

OmegaConf 2.3 has no `Literal` support, so a closed set is a `str` field declared with `choice_field`: its options are
written once, in the field's metadata (OmegaConf ignores metadata), and `check_choices` in `__post_init__` checks
every such field; code that needs the options reads them back with `options(cls, name)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def choice_field(default: str, choices: tuple[str, ...]) -> Any:
    """A dataclass field with `default` that `check_choices` restricts to `choices`."""
    assert default in choices, (default, choices)
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def options(cls_or_obj: Any, name: str) -> tuple[str, ...]:
    """The options a `choice_field` named `name` of a dataclass (class or instance) accepts."""
    for f in dataclasses.fields(cls_or_obj):
        if f.name == name and "choices" in f.metadata:
            return f.metadata["choices"]
    raise KeyError(f"{name!r} is not a choice_field of {getattr(cls_or_obj, '__name__', type(cls_or_obj).__name__)}")


def check_choices(obj: Any, prefix: str) -> None:
    """Check every `choice_field` of dataclass instance `obj`, whose keys are `<prefix>.<field>`."""
    for f in dataclasses.fields(obj):
        if "choices" in f.metadata:
            choice(f"{prefix}.{f.name}", getattr(obj, f.name), f.metadata["choices"])


def choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")


def positive(key: str, value: int | float) -> None:
    if not value > 0:  # written so that NaN fails too
        raise ValueError(f"{key} must be > 0, got {value!r}")


def at_least(key: str, value: int | float, low: int | float) -> None:
    if not value >= low:
        raise ValueError(f"{key} must be >= {low}, got {value!r}")


def in_range(key: str, value: int | float, low: int | float, high: int | float, *, high_open: bool = False) -> None:
    """low <= value <= high (value < high with `high_open`)."""
    if not (low <= value < high if high_open else low <= value <= high):
        raise ValueError(f"{key} must be in [{low}, {high}{')' if high_open else ']'}, got {value!r}")
