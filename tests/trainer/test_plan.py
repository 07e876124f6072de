"""The planner: `python -m trainer.plan model=v41_flash` prints the flagship's figures read off the meta-built model,
within the report's tolerances (backbone 552B +-1%, Engram 196B +-1%, decode-active 16B +-5%, prefill-active 8B
+-10%, global KV exactly 890 B/token and all of it persistent); a bad override fails with a clear message."""

import json
import subprocess
import sys

from tests.helpers import ROOT, load_config
from trainer.plan import plan_model


def _run(*args):
    return subprocess.run([sys.executable, "-m", "trainer.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_flagship_figures_from_cli():
    r = _run("model=v41_flash")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert abs(out["params_backbone"] / 552e9 - 1) < 0.01
    assert abs(out["params_engram"] / 196e9 - 1) < 0.01
    assert abs(out["params_active_decode"] / 16e9 - 1) < 0.05
    assert abs(out["params_active_prefill"] / 8e9 - 1) < 0.10
    assert out["kv_bytes_per_token"] == 890
    assert out["kv_bytes_per_token_persistent"] == out["kv_bytes_per_token"]
    assert out["swa_kv_bytes_per_layer"] == 128 * 528  # one FP8 window: 512 e4m3 values + 16 ue8m0 scales
    assert out["params_total"] == out["params_backbone"] + out["params_engram"]
    assert out["decode_flops_per_token_1m"] > out["decode_flops_per_token_4k"] > 2 * out["params_active_decode"]
    for key in ("params_total", "params_backbone", "params_engram", "params_active_prefill", "params_active_decode",
                "kv_bytes_per_token", "kv_bytes_per_token_persistent", "swa_kv_bytes_per_layer",
                "decode_flops_per_token_4k", "decode_flops_per_token_1m"):
        assert key in out


def test_counts_follow_the_modules():
    """Changing the config changes the figures through the modules, not through a separate formula."""
    cfg = load_config("v41_flash")
    base = plan_model(cfg)
    import dataclasses

    fewer = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=192))
    half = plan_model(fewer)
    per_expert = 3 * cfg.dim * cfg.moe.expert_dim * cfg.num_layers
    assert base["params_routed_experts"] - half["params_routed_experts"] == 192 * per_expert
    bf16 = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, cache_main_kv="bf16"))
    assert plan_model(bf16)["kv_bytes_per_token"] == 2.5 * (1024 + 68)


def test_bad_override_is_reported():
    r = _run("model=v41_flash", "model.moe.experts_per_token=999")
    assert r.returncode != 0
    assert "experts_per_token" in r.stderr
