"""CPU threads (trainer/threads.py): 0 means the cores this process may use, from a faked affinity mask and faked
cgroup v1 / v2 files (a quota in the process's cgroup or an ancestor caps it; "max" and -1 do not), divided by the
processes on the node and never below 1; a number given is kept; the training start-up line says what was picked."""

import os

import pytest
import torch

from tests.trainer.harness import micro_overrides, run_cli
from trainer.threads import ThreadChoice, cgroup_quota, contention_hint, cpu_threads, set_cpu_threads


@pytest.fixture
def cores(monkeypatch):
    """Fake the affinity mask: `cores(n)` makes this process see n cores."""
    def fake(n: int):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    return fake


def _v2(tmp_path, cgroup: str, files: dict[str, str]):
    """A v2 hierarchy under tmp_path/fs with cpu.max files at the given cgroup paths; /proc/self/cgroup at tmp_path."""
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text + "\n")
    (tmp_path / "cgroup").write_text(f"0::{cgroup}\n")
    return dict(root=root, proc_cgroup=tmp_path / "cgroup")


def _v1(tmp_path, mount: str, cgroup: str, quota: int, period: int = 100000):
    root = tmp_path / "fs"
    d = root / mount / cgroup.strip("/")
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    (tmp_path / "cgroup").write_text(f"5:memory:/x\n4:{mount}:{cgroup}\n0::/\n")
    return dict(root=root, proc_cgroup=tmp_path / "cgroup")


def test_no_quota_uses_the_affinity_mask_divided_by_the_processes(tmp_path, cores):
    cores(8)
    where = _v2(tmp_path, "/job", {"job": "max 100000"})
    assert cgroup_quota(**where) is None
    assert cpu_threads(0, processes=1, **where).threads == 8
    assert cpu_threads(0, processes=3, **where).threads == 2  # 8 // 3
    assert cpu_threads(0, processes=16, **where).threads == 1  # never 0


def test_a_v2_quota_caps_the_affinity_also_from_an_ancestor(tmp_path, cores):
    cores(16)
    where = _v2(tmp_path, "/slice/job", {"slice/job": "max 100000", "slice": "250000 100000"})
    assert cgroup_quota(**where) == 2.5
    choice = cpu_threads(0, processes=1, **where)
    assert choice.threads == 2  # 2.5 cores rounded down
    assert choice.describe() == "threads 2 (affinity 16, cgroup quota 2.5 cores, 1 process)"
    assert cpu_threads(0, processes=2, **where).threads == 1


def test_a_v2_quota_on_a_hybrid_mount(tmp_path, cores):
    cores(4)
    where = _v2(tmp_path, "/", {"unified": "100000 100000"})
    assert cgroup_quota(**where) == 1.0
    assert cpu_threads(0, processes=1, **where).threads == 1


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_a_v1_cfs_quota(tmp_path, cores, mount):
    cores(8)
    where = _v1(tmp_path, mount, "/docker/abc", quota=300000)
    assert cgroup_quota(**where) == 3.0
    assert cpu_threads(0, processes=1, **where).threads == 3
    unlimited = _v1(tmp_path / "b", mount, "/docker/abc", quota=-1)
    assert cgroup_quota(**unlimited) is None


def test_a_quota_below_one_core_still_gives_one_thread(tmp_path, cores):
    cores(2)
    where = _v2(tmp_path, "/small", {"small": "50000 100000"})
    choice = cpu_threads(0, processes=1, **where)
    assert (choice.threads, choice.quota) == (1, 0.5)


def test_no_cgroup_files_and_local_world_size(tmp_path, cores, monkeypatch):
    cores(6)
    where = dict(root=tmp_path / "none", proc_cgroup=tmp_path / "missing")
    assert cgroup_quota(**where) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    choice = cpu_threads(0, **where)
    assert (choice.threads, choice.processes) == (3, 2)
    assert choice.describe() == "threads 3 (affinity 6, cgroup quota none, 2 processes)"


def test_a_number_given_is_kept(tmp_path, cores):
    cores(2)
    where = _v2(tmp_path, "/job", {"job": "100000 100000"})
    choice = cpu_threads(5, processes=4, **where)
    assert (choice.threads, choice.given) == (5, True)
    assert choice.describe() == "threads 5 (set)"


def test_set_cpu_threads_applies_the_choice(cores, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    try:
        assert set_cpu_threads(1).threads == 1 and torch.get_num_threads() == 1
        choice = set_cpu_threads(0)
        assert torch.get_num_threads() == choice.threads >= 1
    finally:
        torch.set_num_threads(before)


def test_a_machine_busier_than_its_cores_gets_a_hint(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    two, one = ThreadChoice(2, False, 2, None, 1), ThreadChoice(1, False, 2, None, 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.4, 4.0, 3.0))
    hint = contention_hint(two, "trainer.num_threads")
    assert hint.startswith("the machine's load average 5.4 exceeds its 2 cores: 2 threads") and \
        "set trainer.num_threads=1 or OMP_WAIT_POLICY=PASSIVE" in hint
    assert contention_hint(one, "trainer.num_threads") is None  # one thread waits for no other
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert contention_hint(two, "num_threads") is None  # waiting threads sleep: nothing collapses
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 4.0, 3.0))
    assert contention_hint(two, "num_threads") is None  # the cores keep up


def test_training_start_up_says_the_threads(tmp_path, small_data):
    """The start-up line (main.log) names the threads picked for trainer.num_threads=0 and where they came from; two
    processes on the node (LOCAL_WORLD_SIZE=2) share the cores, which keeps this run off the second core here."""
    run = tmp_path / "run"
    args = [a for a in micro_overrides(run, small_data) if not a.startswith("trainer.num_threads")]
    r = run_cli([*args, "trainer.max_steps=1", "checkpoint.interval=0", "checkpoint.save_final=false",
                 "trainer.num_threads=0"], LOCAL_WORLD_SIZE="2")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [ln for ln in (run / "main.log").read_text().splitlines() if "parallel layout" in ln]
    want = cpu_threads(0, processes=2)
    assert line.endswith(f"; CPU {want.describe()}"), line
    assert f"threads {want.threads} (affinity " in line and "2 processes)" in line
