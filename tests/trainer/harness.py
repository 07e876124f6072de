"""Helpers for the trainer tests: a micro model, the CLI in a subprocess, and readers for what a run leaves
behind (metrics.jsonl, W&B offline files)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.fork_server import run_module, run_modules

REPO = Path(__file__).resolve().parents[2]

# v41_tiny shrunk until a step takes tens of milliseconds on one core, keeping every structural feature: an SWA
# layer and a ratio-2 Full layer in the encoder, a ratio-1 decoder Full layer that reads h_{L/2} and builds the
# candidate pool, a Reindex layer searching it, Engram, MoE with a shared expert, and mHC.
MICRO_MODEL = [
    "model.dim=32", "model.num_layers=4", "model.num_encoder_layers=2",
    "model.attention.num_heads=2", "model.attention.head_dim=16", "model.attention.rope_dim=8",
    "model.attention.q_lora_rank=16", "model.attention.o_groups=1", "model.attention.o_lora_rank=16",
    "model.attention.window=8",
    "model.csa2.compress_ratios=[0,2,1,1]", "model.csa2.kv_source_layers=[1,2]",
    "model.csa2.index_source_layers=[1,2,3]", "model.csa2.index_num_heads=2", "model.csa2.index_head_dim=8",
    "model.csa2.index_topk=4", "model.csa2.candidate_source_layer=2", "model.csa2.candidate_block_size=4",
    "model.csa2.candidate_topk_blocks=2",
    "model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.expert_dim=32",
    "model.mhc.num_streams=2", "model.mhc.sinkhorn_iters=5",
    "model.engram.layers=[1]", "model.engram.num_heads=2", "model.engram.head_dim=8", "model.engram.max_ngram=3",
    "model.engram.prime_start=500",
]

# A small slice of the default corpus: prepared once per session by the `small_data` fixture.
SMALL_DATA = ["data.max_bytes=400000", "data.shard_size=16384"]

QUIET = ["logger.wandb.mode=disabled", "logger.progress_bar=false", "trainer.num_threads=1"]


def micro_overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [
        f"hydra.run.dir={run_dir}", f"data.path={data_dir}", *SMALL_DATA, *MICRO_MODEL,
        "data.seq_len=32", "data.batch_size=4", *QUIET, *extra,
    ]


def env(**extra: str) -> dict:
    out = dict(os.environ)
    out.update({"WANDB_SILENT": "true", "WANDB_MODE": "", "HYDRA_FULL_ERROR": "", **extra})
    return {k: v for k, v in out.items() if v != ""}


def run_cli(args: list[str], timeout: float = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """`python -m trainer.cli.main ARGS` from the repository root, forked from the suite's fork server
    (tests/fork_server.py: the same CompletedProcess, without a fresh interpreter's imports)."""
    return run_module("trainer.cli.main", args, cwd=REPO, env=env(**env_extra), timeout=timeout)


def run_ranks(nproc: int, args: list[str], timeout: float = 300, module: str = "trainer.cli.main",
              **env_extra: str) -> subprocess.CompletedProcess:
    """What `launch/torchrun.sh NPROC ARGS` computes, without torchrun's processes: NPROC ranks of
    `python -m MODULE ARGS` forked from the fork server, each with the environment torchrun gives a worker
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, the env:// rendezvous on a store this process hosts as
    torchrun's agent does, one TORCHELASTIC_RUN_ID, OMP_NUM_THREADS=1). For the tests of what a layout computes;
    the launcher itself (its preflight, exit statuses, signals, a dead or hung rank) is tested through
    launch/torchrun.sh. One CompletedProcess: the exit status 0 when every rank succeeded, else that of the first
    rank that failed by itself (its peers are killed, as torchrun kills them); stdout and stderr the ranks' in rank
    order."""
    import uuid
    from datetime import timedelta

    from torch.distributed import TCPStore

    # The rendezvous store is hosted here, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE: every rank a
    # client): its port is the OS's pick for a socket that stays open, so no other process can take it meanwhile.
    store = TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, timeout=timedelta(seconds=timeout),
                     wait_for_workers=False)
    run_id = uuid.uuid4().hex
    base = env(**env_extra)
    runs = [(module, args, {**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
                            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                            "TORCHELASTIC_RUN_ID": run_id, "OMP_NUM_THREADS": "1"})
            for r in range(nproc)]
    try:
        results = run_modules(runs, cwd=REPO, timeout=timeout)
    finally:
        del store
    failed = [r.returncode for r in results if r.returncode != 0]
    positive = [c for c in failed if c > 0]
    code = positive[0] if positive else failed[0] if failed else 0
    return subprocess.CompletedProcess(["torchrun", f"--nproc_per_node={nproc}", "-m", module, *args], code,
                                       "".join(r.stdout for r in results), "".join(r.stderr for r in results))


def kill_9_when(args: list[str], ready, timeout: float = 300) -> int:
    """Launch `python -m trainer.cli.main ARGS`, SIGKILL it as soon as ready() is true, and return its exit status
    (-SIGKILL when it was killed, its own status when it finished first)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli.main", *args], cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if ready():
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    return proc.returncode


def run_faulty(faults: str, args: list[str], timeout: float = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """`python -m trainer.cli.main ARGS` with faults patched in (tests/trainer/faults.py)."""
    return run_module("tests.trainer.faults", [faults, "--", *args], cwd=REPO, env=env(**env_extra), timeout=timeout)


def side_by_side(*runs):
    """Call each of `runs` (functions that start a process and wait for it: `run_cli`, a torchrun launch) at the same
    time, one thread each; their results in order. For independent runs only: a single-process run trains on one
    thread (trainer.num_threads=1) and spends seconds starting up, so two together leave no core of two idle."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return [f.result() for f in [pool.submit(run) for run in runs]]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def read_wandb_records(path: Path) -> list:
    """Decode a .wandb transaction log: W&B's 7-byte header, then LevelDB-log framing (32 KiB blocks of
    records with a 7-byte header: crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4), each payload one
    protobuf `Record` from wandb's own schema."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, pending, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def wandb_history(path: Path) -> list[dict]:
    """The rows logged with run.log(), as {key: value} with values decoded from JSON."""
    rows = []
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
