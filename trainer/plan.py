"""The planner: `python -m trainer.plan model=<name> [overrides...]` prints one JSON object of counts read off the
model built on the meta device (see model/accounting.py for what each count includes).

Example: `python -m trainer.plan model=v41_flash` -> params_total, params_backbone, params_engram,
params_active_prefill, params_active_decode, kv_bytes_per_token, kv_bytes_per_token_persistent,
swa_kv_bytes_per_layer, decode_flops_per_token_4k, decode_flops_per_token_1m (and a few breakdowns).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: list[str]):
    """The job config with Hydra's override syntax, without starting a run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def plan_model(model_cfg) -> dict:
    import model as model_pkg
    from model import accounting

    cfg = model_pkg.to_model_config(model_cfg)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    out = {"model": cfg.name}
    out.update(accounting.summary(m))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = compose(argv)
        result = plan_model(cfg.model)
    except ValueError as e:  # config and layer-plan errors name the key and the rule
        sys.exit(f"error: {e}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
