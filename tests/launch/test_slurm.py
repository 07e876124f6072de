"""launch/slurm.sbatch under a fake Slurm: stub `srun`, `scontrol`, `squeue`, `nvidia-smi` and `date` on PATH, a
stub `python` standing in for torchrun (it starts one stub worker), SLURM_* variables set. (launch/slurm_local.sh
sets up a real single-node Slurm to try the same by hand.) It proves:

- the header asks for the time-limit signal to the batch shell (`--signal=B:USR1@<s>`), `--requeue` and an
  appended log, all before the first command (sbatch reads no #SBATCH line after it);
- the one srun step runs torchrun with the rendezvous at the head node's Slurm name and $RDZV_PORT, passes
  `--cpus-per-task` on (srun no longer inherits it), and fixes `hydra.run.dir=runs/slurm-<job id>`, the same for
  every start of the job (no clock in it);

The rest of what it proves: docs/testing.md#the-slurm-launcher
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "launch" / "slurm.sbatch"
JOB_ID = "4242"

STUBS = {
    # srun: records its arguments, runs the task locally as the one "node", passes SIGUSR1 on like srun, and on
    # SIGTERM does what srun does ("forcing job termination"): SIGKILL the task.
    "srun": r"""
n=$(ls "$CEDAR_LOG" | grep -c '^srun\.' || true)
printf '%s\0' "$@" > "$CEDAR_LOG/srun.$n.argv"
while [[ $1 == -* ]]; do shift; done
"$@" &
task=$!
trap 'echo "srun USR1" >> "$CEDAR_LOG/events"; kill -USR1 $task' USR1
trap 'echo "srun TERM" >> "$CEDAR_LOG/events"; kill -KILL $task' TERM
rc=0
while kill -0 $task 2>/dev/null; do rc=0; wait $task || rc=$?; done
exit $rc
""",
    # squeue -o '%l %L': the time limit and the time left; by default a signal on time (10 min before a 1 h limit)
    "squeue": r"""
echo "${CEDAR_FAKE_TIMES:-1:00:00 10:00}"
""",
    "scontrol": r"""
echo "scontrol $*" >> "$CEDAR_LOG/events"
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\n' gpu-head gpu-b; fi
""",
    # a GPU node's four GPUs; with CEDAR_FAKE_NO_GPU=1 a node without a driver
    "nvidia-smi": r"""
if [[ ${CEDAR_FAKE_NO_GPU:-0} == 1 ]]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2; exit 9
fi
for i in 0 1 2 3; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done
""",
    # A clock that never shows the same time twice: a run directory built from it would differ between starts.
    "date": r"""
n=$(cat "$CEDAR_LOG/date" 2>/dev/null || echo 0); echo $((n + 1)) > "$CEDAR_LOG/date"; echo "2031-01-0$((n % 9 + 1))"
""",
    # torchrun (trainer/cli/torchrun.py): records its arguments and its ignored-signal mask, starts one worker, passes
    # a SIGTERM on to it and waits for it, ending with its exit status.
    "fake-python": r"""
if [[ $1 == -m && $2 == trainer.cli.preflight ]]; then  # the preflight: records its arguments, passes
  printf '%s\0' "$@" > "$CEDAR_LOG/preflight.argv"
  sleep "${CEDAR_FAKE_PREFLIGHT_S:-0}"
  exit "${CEDAR_FAKE_PREFLIGHT_RC:-0}"
fi
printf '%s\0' "$@" > "$CEDAR_LOG/torchrun.argv"
awk '/^SigIgn/ {print $2}' /proc/$$/status > "$CEDAR_LOG/torchrun.sigign"
[[ ${CEDAR_FAKE_WORKER:-1} == 1 ]] || exit 0
"$(dirname "$0")/fake-worker" &
worker=$!
trap 'echo "torchrun TERM" >> "$CEDAR_LOG/events"; kill -TERM $worker' TERM
rc=0
while kill -0 $worker 2>/dev/null; do rc=0; wait $worker || rc=$?; done
echo "torchrun exit $rc" >> "$CEDAR_LOG/events"
exit $rc
""",
    # A trainer rank: on SIGTERM finishes "its step", saves (a complete checkpoint in the run directory, unless
    # CEDAR_FAKE_SAVE=0), says so and exits with CEDAR_FAKE_STOP_RC (0); gives up after 30 s unsignalled.
    "fake-worker": r"""
stop() {
  echo "worker TERM" >> "$CEDAR_LOG/events"
  sleep 0.2
  if [[ ${CEDAR_FAKE_SAVE:-1} == 1 ]]; then
    mkdir -p runs/slurm-4242/checkpoints/step_7 && touch runs/slurm-4242/checkpoints/step_7/COMPLETE
    echo "stopped by SIGTERM at step 7: checkpoint saved to runs/slurm-4242/checkpoints/step_7"
    echo "worker saved" >> "$CEDAR_LOG/events"
  fi
  exit "${CEDAR_FAKE_STOP_RC:-0}"
}
trap stop TERM
echo "worker start" >> "$CEDAR_LOG/events"
for ((i = 0; i < ${CEDAR_FAKE_WORKER_S:-30} * 10; i++)); do sleep 0.1; done
echo "worker unsignalled" >> "$CEDAR_LOG/events"
exit 1
""",
}


@pytest.fixture
def fake_slurm(tmp_path):
    """(env, log dir): stubs first on PATH, a fake job of 2 nodes x 8 GPUs submitted from tmp_path."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body.lstrip())
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "CEDAR_")) and k not in ("RUN_DIR", "NPROC_PER_NODE",
                                                                             "RDZV_PORT", "REQUEUE_ON_SIGTERM",
                                                                             "PYTHON")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "fake-python"), CEDAR_LOG=str(log),
               SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST="gpu-[head,b]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8",
               SLURM_CPUS_PER_TASK="16", SLURM_SUBMIT_DIR=str(tmp_path))
    return env, log


def _argv(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def _events(log: Path) -> list[str]:
    path = log / "events"
    return path.read_text().splitlines() if path.exists() else []


def _run(env, *overrides, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *overrides], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_header_asks_for_the_signal_requeue_and_an_appended_log():
    lines = SCRIPT.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    header = [line.split(None, 1)[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    after = [line for line in lines[first_command:] if line.startswith("#SBATCH")]
    assert not after, f"sbatch ignores #SBATCH lines after the first command: {after}"
    signal_opts = [opt for opt in header if opt.startswith("--signal=")]
    assert len(signal_opts) == 1, header
    m = re.fullmatch(r"--signal=B:USR1@(\d+)", signal_opts[0])
    assert m and int(m.group(1)) >= 120, signal_opts  # to the batch shell, minutes before the limit
    assert "--requeue" in header and "--open-mode=append" in header


def test_torchrun_command_line(fake_slurm):
    env, log = fake_slurm
    r = _run({**env, "CEDAR_FAKE_WORKER": "0"}, "model=v41_tiny", "trainer.max_steps=10")
    assert r.returncode == 0, r.stderr
    assert not list(log.glob("srun.1.argv")), "one srun step only (no step to look up the head's address)"
    srun = _argv(log / "srun.0.argv")
    options = srun[:next(i for i, a in enumerate(srun) if not a.startswith("-"))]
    assert "--cpus-per-task=16" in options and "--kill-on-bad-exit=1" in options
    torchrun = _argv(log / "torchrun.argv")
    assert torchrun[:2] == ["-m", "trainer.cli.torchrun"]
    for arg in ("--nnodes=2", "--nproc_per_node=8", f"--rdzv_id={JOB_ID}", "--rdzv_backend=c10d",
                "--rdzv_endpoint=gpu-head:29500"):
        assert arg in torchrun, (arg, torchrun)
    rest = torchrun[torchrun.index("-m", 1):]
    assert rest == ["-m", "trainer.cli.main", f"hydra.run.dir=runs/slurm-{JOB_ID}", "model=v41_tiny",
                    "trainer.max_steps=10"]
    assert "rendezvous gpu-head:29500" in r.stdout
    assert not any("requeue" in e for e in _events(log))  # a job that ends by itself is not requeued
    # the trainer's start-up checks ran first, against the whole job: 2 nodes x 8 processes
    assert _argv(log / "preflight.argv") == ["-m", "trainer.cli.preflight", "16", f"hydra.run.dir=runs/slurm-{JOB_ID}",
                                             "model=v41_tiny", "trainer.max_steps=10"]


def test_a_layout_the_trainer_refuses_starts_no_step(fake_slurm):
    env, log = fake_slurm
    r = _run({**env, "CEDAR_FAKE_PREFLIGHT_RC": "2"}, "parallel.dp_replicate=3")
    assert r.returncode == 2
    assert not list(log.glob("srun.*.argv")) and not (log / "torchrun.argv").exists()


def test_requeued_job_keeps_its_run_directory(fake_slurm):
    env, log = fake_slurm
    env = {**env, "CEDAR_FAKE_WORKER": "0", "RDZV_PORT": "29611"}
    dirs = []
    for restart in ("0", "1"):
        assert _run({**env, "SLURM_RESTART_COUNT": restart}).returncode == 0
        torchrun = _argv(log / "torchrun.argv")
        assert "--rdzv_endpoint=gpu-head:29611" in torchrun
        dirs.append([a for a in torchrun if a.startswith("hydra.run.dir=")])
    assert dirs == [[f"hydra.run.dir=runs/slurm-{JOB_ID}"]] * 2


def test_without_cpus_per_task_or_gpu_count(fake_slurm):
    env, log = fake_slurm
    env = {k: v for k, v in env.items() if k not in ("SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE")}
    assert _run({**env, "CEDAR_FAKE_WORKER": "0"}).returncode == 0
    assert not any(a.startswith("--cpus-per-task") for a in _argv(log / "srun.0.argv"))
    assert "--nproc_per_node=4" in _argv(log / "torchrun.argv")  # nvidia-smi -L


@pytest.mark.parametrize("extra, nproc", [({}, "1"), ({"NPROC_PER_NODE": "3"}, "3")])
def test_a_cpu_node_runs_one_process_without_extra_variables(fake_slurm, extra, nproc):
    env, log = fake_slurm
    env = {k: v for k, v in env.items() if k != "SLURM_GPUS_ON_NODE"}  # what --gpus-per-node=0 leaves
    r = _run({**env, "CEDAR_FAKE_NO_GPU": "1", "CEDAR_FAKE_WORKER": "0", **extra})
    assert r.returncode == 0, r.stderr
    assert f"--nproc_per_node={nproc}" in _argv(log / "torchrun.argv")
    assert _argv(log / "preflight.argv")[2] == str(2 * int(nproc))  # 2 nodes


def _signalled_run(env, log, sig, when="worker start", args=("model=v41_tiny",)):
    """Start the batch script, send `sig` once `when` is among the events, return (completed process, events).
    Output goes to files, so a stray process left holding it cannot stall the test; whatever is left of the script's
    process group afterwards is killed."""
    out_path, err_path = log / "stdout", log / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, stdout=out, stderr=err,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (log / when).exists() if when.endswith(".argv") else when not in _events(log):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, f"never got to {when!r}"
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out_path.read_text(), err_path.read_text()), \
        _events(log)


def _assert_graceful_stop(log, events):
    assert "srun TERM" not in events, events  # srun would SIGKILL its tasks
    assert "srun USR1" in events, events
    assert events.count("torchrun TERM") == 1 and events.count("worker TERM") == 1, events
    assert "worker unsignalled" not in events
    assert events.index("worker saved") < events.index("torchrun exit 0"), events
    # torchrun and so its workers run with SIGUSR1 ignored (bit 10 - 1 of the mask)
    assert int((log / "torchrun.sigign").read_text(), 16) & (1 << (signal.SIGUSR1 - 1))


def _requeues(events):
    return [e for e in events if e.startswith("scontrol requeue")]


def test_time_limit_signal_stops_the_ranks_then_requeues(fake_slurm):
    env, log = fake_slurm
    r, events = _signalled_run(env, log, signal.SIGUSR1)
    assert r.returncode == 0, (r.stdout, r.stderr)
    _assert_graceful_stop(log, events)
    assert _requeues(events) == [f"scontrol requeue {JOB_ID}"], events
    assert events.index(_requeues(events)[0]) > events.index("torchrun exit 0")  # after the step saved and ended
    assert f"requeueing job {JOB_ID}" in r.stdout
    assert "does not fit" not in r.stdout  # on time: not held back


@pytest.mark.parametrize("requeue", ["0", "1"])
def test_sigterm_stops_the_ranks_and_requeues_only_when_asked(fake_slurm, requeue):
    env, log = fake_slurm
    r, events = _signalled_run({**env, "REQUEUE_ON_SIGTERM": requeue}, log, signal.SIGTERM)
    assert r.returncode == 0, (r.stdout, r.stderr)
    _assert_graceful_stop(log, events)
    assert _requeues(events) == ([f"scontrol requeue {JOB_ID}"] if requeue == "1" else []), events


@pytest.mark.parametrize("stop_rc", ["0", "143"])
def test_no_requeue_without_a_checkpoint_since_the_start(fake_slurm, stop_rc):
    env, log = fake_slurm
    # a complete checkpoint of an earlier start of the job does not count
    old = Path(env["SLURM_SUBMIT_DIR"]) / f"runs/slurm-{JOB_ID}/checkpoints/step_3"
    old.mkdir(parents=True)
    (old / "COMPLETE").touch()
    os.utime(old / "COMPLETE", (time.time() - 3600, time.time() - 3600))
    r, events = _signalled_run({**env, "CEDAR_FAKE_SAVE": "0", "CEDAR_FAKE_STOP_RC": stop_rc}, log, signal.SIGUSR1)
    assert r.returncode == int(stop_rc), (r.stdout, r.stderr)  # the step's own status
    assert _requeues(events) == [], events
    assert r.stderr.strip().splitlines() == [
        f"cedar: not requeueing job {JOB_ID}: no checkpoint saved in runs/slurm-{JOB_ID} since this start (the step "
        f"ended with exit status {stop_rc})"]


def test_a_run_directory_of_the_overrides_is_the_one_checked(fake_slurm):
    env, log = fake_slurm
    r, events = _signalled_run(env, log, signal.SIGUSR1, args=("model=v41_tiny", "hydra.run.dir=runs/mine"))
    assert r.returncode == 0
    # the fake worker saved under runs/slurm-<job id>, not in runs/mine, the run directory the trainer was given
    assert _requeues(events) == [] and "no checkpoint saved in runs/mine" in r.stderr, (r.stdout, r.stderr)


def test_a_signal_lead_longer_than_the_time_limit_is_clamped_to_half_the_limit(fake_slurm):
    env, log = fake_slurm
    # Slurm sends the signal at once: 4 s of a 4 s time limit left; the stop is held back 2 s
    t0 = time.monotonic()
    r, events = _signalled_run({**env, "CEDAR_FAKE_TIMES": "0:04 0:04"}, log, signal.SIGUSR1)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert time.monotonic() - t0 >= 2
    lines = [line for line in r.stdout.splitlines() if "does not fit" in line]
    assert len(lines) == 1 and lines[0].startswith("cedar: SIGUSR1 came ") and \
        lines[0].endswith("4 s before the time limit of 4 s: the --signal lead does not fit --time; clamped to 2 s "
                          "(half the limit)"), r.stdout
    _assert_graceful_stop(log, events)
    assert _requeues(events) == [f"scontrol requeue {JOB_ID}"], events


def test_a_held_back_signal_leaves_nothing_running_when_the_step_ends_first(fake_slurm):
    env, log = fake_slurm
    # held back 30 s; the worker ends by itself (unsignalled, exit status 1) after 1 s
    out_path, err_path = log / "stdout", log / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", str(SCRIPT)], env={**env, "CEDAR_FAKE_TIMES": "1:00 1:00",
                                                            "CEDAR_FAKE_WORKER_S": "1"},
                                stdout=out, stderr=err, start_new_session=True)
    try:
        while "worker start" not in _events(log):
            assert proc.poll() is None, err_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=20) == 1
        assert "clamped to 30 s" in out_path.read_text()
        time.sleep(0.2)
        # the timer and its sleep are gone with the script (zombies waiting for init to reap them aside)
        left = subprocess.run(["ps", "-o", "stat=,pid=,args=", "--sid", str(proc.pid)], capture_output=True,
                              text=True).stdout.splitlines()
        assert [line for line in left if not line.startswith("Z")] == [], left
        # and quietly: the slurm log of a job that finished before its held-back signal ended in bash's "line 130:
        # 25158 Killed  sleep ..." (a real Slurm, issue 44 re-run)
        assert "Killed" not in err_path.read_text() + out_path.read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert _requeues(_events(log)) == [] and "worker TERM" not in _events(log)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_before_the_step_starts_starts_none(fake_slurm, sig):
    env, log = fake_slurm
    # during the preflight, with the time-limit signal on time: the batch shell traps it from its first line
    r, events = _signalled_run({**env, "CEDAR_FAKE_PREFLIGHT_S": "1"}, log, sig, when="preflight.argv")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cedar: SIG{sig.name[3:]} before the training step started: not starting it" in r.stderr
    assert not list(log.glob("srun.*.argv")) and _requeues(events) == []


def _call(function: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run one of the batch script's functions alone (its definition cut out of the script, nothing else run)."""
    lines = SCRIPT.read_text().splitlines()
    start = lines.index(f"{function}() {{")
    body = "\n".join(lines[start:lines.index("}", start) + 1])
    return subprocess.run(["bash", "-c", f'set -euo pipefail\n{body}\n{function} "$@"', function, *args],
                          env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("text, seconds", [("4:05", 245), ("1:00:00", 3600), ("2-03:04:05", 183845),
                                           ("0:09", 9), ("08:09", 489)])
def test_squeue_times_in_seconds(text, seconds):
    r = _call("to_seconds", text)
    assert r.returncode == 0 and r.stdout.strip() == str(seconds), r


@pytest.mark.parametrize("text", ["UNLIMITED", "NOT_SET", "", "1:2:3:4"])
def test_squeue_times_that_are_no_duration_fail(text):
    assert _call("to_seconds", text).returncode != 0


@pytest.mark.parametrize("elapsed, limit, left, wait", [
    (3, 300, 297, "147"),  # Slurm's signal at the start: held until half the limit is left
    (30, 120, 90, "30"),
    (40, 86400, 600, ""),  # on time
    (100, 300, 200, ""),  # after the first 90 s: a lead the user chose (or a user's signal)
    (5, 300, 140, ""),  # less than half left already
])
def test_lead_clamp(elapsed, limit, left, wait):
    r = _call("lead_clamp_wait", str(elapsed), str(limit), str(left))
    assert r.returncode == 0 and r.stdout.strip() == wait, r


def test_saved_since_counts_complete_checkpoints_newer_than_the_start(tmp_path):
    start = int(time.time()) - 100
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".tmp_step_9").mkdir(parents=True)  # a save in progress: no marker
    assert _call("saved_since", str(tmp_path), str(start)).returncode != 0
    (ckpts / "step_3").mkdir()
    (ckpts / "step_3" / "COMPLETE").touch()
    os.utime(ckpts / "step_3" / "COMPLETE", (start - 50, start - 50))  # an earlier start's
    assert _call("saved_since", str(tmp_path), str(start)).returncode != 0
    (ckpts / "step_8").mkdir()
    (ckpts / "step_8" / "COMPLETE").touch()
    assert _call("saved_since", str(tmp_path), str(start)).returncode == 0
    assert _call("saved_since", str(tmp_path / "missing"), str(start)).returncode != 0


# sbatch 22.05's options (`sbatch --help` of Debian's slurm-wlm 22.05.8) that the documented commands use or may use
SBATCH_OPTIONS = {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time", "--signal",
                  "--requeue", "--no-requeue", "--exclusive", "--oversubscribe", "--output", "--open-mode",
                  "--job-name", "--partition", "--gres", "--mem", "--account", "--qos", "--dependency"}


def test_the_documented_sbatch_commands_use_options_sbatch_has():
    """From a fresh clone (issue 44): slurm_local.sh's header told a user to submit with `--no-exclusive`, which
    sbatch 22.05 refuses ("unrecognized option"). Every `sbatch ...` line of the READMEs and of that header uses only
    options sbatch has (the list above is checked by hand against `sbatch --help`)."""
    texts = [(ROOT / p).read_text() for p in ("README.md", "launch/README.md", "launch/slurm_local.sh")]
    lines = [ln for t in texts for ln in t.splitlines() if re.search(r"(^|[\s`#])sbatch --", ln)]
    assert len(lines) >= 4
    options = [c.group(1) for ln in lines for c in re.finditer(r"sbatch((?: --[\w-]+(?:=\S+)?| \d+)+)", ln)]
    used = {o for text in options for o in re.findall(r"--[\w-]+", text)}
    assert used and used <= SBATCH_OPTIONS, sorted(used - SBATCH_OPTIONS)
