"""The training library (README.md, "Layout").

`CONF_DIR`: the Hydra configs every entry point composes, found from the package's location, never from the working
directory: the repository's `conf/` in a checkout or an editable install, the package's `conf/` in an installed wheel
(pyproject.toml installs conf/ as `trainer/conf/`)."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"
