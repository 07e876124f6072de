"""Metrics logging: only rank 0 writes; each log call is one JSON object per line in <run dir>/metrics.jsonl;
a resume drops records past the resumed step; W&B offline files stay inside the run directory and read back
with wandb's own record schema; the MFU peak and memory readings are positive numbers on this machine."""

import json
import time

import torch

from tests.trainer.harness import wandb_history
from trainer.config import WandbConfig
from trainer.metrics import MetricsLogger, device_peak_flops, memory_mb


def test_jsonl_one_object_per_step_and_truncate(tmp_path):
    logger = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), rank=0)
    for step in (1, 2, 3):
        logger.log(step, {"loss": 1.0 / step, "lr": 0.1})
    logger.truncate_after(2)
    logger.log(3, {"loss": 0.25, "lr": 0.1})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 1.0, "lr": 0.1}, {"step": 2, "loss": 0.5, "lr": 0.1},
                    {"step": 3, "loss": 0.25, "lr": 0.1}]
    assert not (tmp_path / "wandb").exists()


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, WandbConfig(mode="offline"), rank=1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_run_inside_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, WandbConfig(mode="offline", tags=["test"]), rank=0, config={"a": {"b": 1}})
    for step in (1, 2):
        logger.log(step, {"loss": 3.0 - step, "aux/indexer_kl": 0.5})
    wandb_dir = logger.wandb_dir
    logger.close()
    assert wandb_dir is not None and wandb_dir.parent == tmp_path / "wandb"
    (wandb_file,) = wandb_dir.glob("run-*.wandb")
    # W&B's service process may still be writing the transaction log when finish() returns (one fresh-clone CI run
    # read no history rows): wait up to 20 s for the rows to land
    deadline = time.monotonic() + 20
    while len(history := wandb_history(wandb_file)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [(h["_step"], h["loss"], h["aux/indexer_kl"]) for h in history] == [(1, 2.0, 0.5), (2, 1.0, 0.5)]


def test_peak_flops_and_memory_are_positive():
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, override=123.0) == 123.0
    state = torch.get_rng_state()
    assert device_peak_flops(cpu) > 1e8  # measured: any CPU running PyTorch does > 0.1 GFLOP/s
    assert torch.equal(torch.get_rng_state(), state)  # the measurement leaves the training RNG stream alone
    assert memory_mb(cpu) > 10
