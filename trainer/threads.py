"""CPU threads: how many a process uses when the user leaves the number at 0 (`trainer.num_threads`, generate's and
evaluate's `num_threads`).

torch's default is one thread per core of the affinity mask: in a container with a CPU quota, or with several
processes per node, that oversubscribes the cores. `cpu_threads(0)` counts the cores this process may use: its
affinity mask (`os.sched_getaffinity`: taskset, Slurm's cpusets), capped by the CFS quota
of its cgroup and every ancestor (v2 `cpu.max`; v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), divided by the
processes of this job on the node (`LOCAL_WORLD_SIZE`, torchrun's), at least 1. A number the user gives is used as
it is. `ThreadChoice.describe()` is the start-up line's words for the choice; `contention_hint` the warning for a
machine busier than its cores.

Cores that are ours can still be busy with other processes; OpenMP's threads then spin while they wait for each other
and collapse (the figures: README, "CPU threads").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ThreadChoice", "affinity_cores", "cgroup_quota", "contention_hint", "cpu_threads", "set_cpu_threads"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class ThreadChoice:
    """The threads picked and what they were picked from."""

    threads: int
    given: bool  # the user set the number (not 0)
    affinity: int  # cores in this process's affinity mask
    quota: float | None  # the cgroup CPU quota in cores; None: no quota
    processes: int  # processes of the job on this node

    def describe(self) -> str:
        if self.given:
            return f"threads {self.threads} (set)"
        quota = "none" if self.quota is None else f"{self.quota:g} cores"
        processes = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        return f"threads {self.threads} (affinity {self.affinity}, cgroup quota {quota}, {processes})"


def affinity_cores() -> int:
    """Cores this process may run on (its affinity mask; all of the machine's where the OS has no such call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _ancestors(path: str) -> list[str]:
    """`/a/b` -> [`a/b`, `a`, ``]: a cgroup and the ones above it, relative to the hierarchy's root."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _v2_quota(directory: Path) -> float | None:
    """cpu.max "<quota> <period>" (or "max <period>") of one v2 cgroup, in cores."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    fields = text.split()
    if fields[0] == "max" or len(fields) < 2:
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us of one v1 cgroup, in cores (-1: no quota)."""
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota, in cores, of this process's cgroup: the smallest over the cgroup and its ancestors, in the v2
    hierarchy (`root` or `root/unified` on a hybrid mount) and in v1's cpu controller. None: no quota (or no cgroup
    file to read, e.g. not Linux)."""
    lines = (_read(proc_cgroup) or "").splitlines()
    found: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: "0::/path"
            for base in (root, root / "unified"):
                found += [q for rel in _ancestors(path) if (q := _v2_quota(base / rel)) is not None]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")):
                found += [q for rel in _ancestors(path) if (q := _v1_quota(root / mount / rel)) is not None]
    return min(found) if found else None


def cpu_threads(requested: int = 0, *, processes: int | None = None, root: Path = CGROUP_ROOT,
                proc_cgroup: Path = PROC_CGROUP) -> ThreadChoice:
    """The threads for this process: `requested` when > 0; else the cores it may use (affinity, capped by the cgroup
    quota rounded down) divided by `processes` (default: LOCAL_WORLD_SIZE, else 1), at least 1."""
    processes = max(1, processes if processes is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    affinity = affinity_cores()
    quota = cgroup_quota(root, proc_cgroup)
    if requested > 0:
        return ThreadChoice(requested, True, affinity, quota, processes)
    cores = affinity if quota is None else min(affinity, max(1, math.floor(quota)))
    return ThreadChoice(max(1, cores // processes), False, affinity, quota, processes)


def set_cpu_threads(requested: int = 0) -> ThreadChoice:
    """`cpu_threads(requested)` applied to torch's intra-op pool; returns the choice (its `describe()` for the log)."""
    choice = cpu_threads(requested)
    torch.set_num_threads(choice.threads)
    return choice


def contention_hint(choice: ThreadChoice, key: str) -> str | None:
    """A warning when `choice` runs several threads on a machine whose load average over the last minute exceeds its
    cores (other processes compete for them) and OpenMP's waiting threads spin (OMP_WAIT_POLICY not passive); `key`
    is the setting to name (trainer.num_threads). None otherwise."""
    if choice.threads < 2 or os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"the machine's load average {load:.1f} exceeds its {cores} cores: {choice.threads} threads that wait for "
            f"each other may run many times slower than 1; if tokens/s is low, set {key}=1 or OMP_WAIT_POLICY=PASSIVE "
            "(README, 'CPU threads')")
