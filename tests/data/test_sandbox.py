"""The sandbox (data/envs/sandbox.py) contains hostile programs. Each class of attack is run with the audit hook (the
reason it reports) and, where the hook is the only thing a native-code program would get past, without it
(`guard=False`: only bubblewrap's namespaces, the seccomp filter and the rlimits): starting processes (including
by native code through ctypes), leaving daemons behind, writes and deletes outside, sqlite's ATTACH / VACUUM INTO,
device nodes, signals and scheduling of other processes, terminal injection, the network, reading the parent's
memory or files, forged verdicts, memory, disk, thread and CPU exhaustion, and reward hacks through python_fn's
scorer. Every test ends with nothing left running (no process in another PID namespace, no child), nothing
changed outside, the run's directory removed and the test process's limits untouched. bwrap is required: where
it is missing these tests fail (the Makefile installs it), only the opt-in test runs without it."""

import ast
import logging
import os
import random
import resource
import socket
import sys
import threading
import time

import pytest

from data.envs import sandbox as sandbox_module
from data.envs.base import Problem
from data.envs.python_fn import PythonFn
from data.envs.sandbox import (
    BLOCKED_EXIT,
    OUTPUT_LIMIT,
    SANDBOX_UID,
    SandboxUnavailable,
    run_many,
    run_sandboxed,
    sandbox_backend,
)
from data.envs.seccomp import filter_program

_LIMITS = [resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NPROC,
           resource.RLIMIT_NOFILE]


def _stat_fields(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 :].split()


def _children():
    """Processes whose parent is this test process, zombies included."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_stat_fields(name)[1]) == os.getpid():
                found.append(int(name))
        except OSError:  # exited meanwhile
            continue
    return found


def _in_other_pid_namespaces():
    """Live processes in a PID namespace other than ours (a sandbox's)."""
    ours, found = os.readlink("/proc/self/ns/pid"), set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ours and _stat_fields(name)[0] not in (b"Z", b"X"):
                found.add(int(name))
        except OSError:
            continue
    return found


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(200).replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "(exited)"


@pytest.fixture
def root(tmp_path):
    """The sandboxes' tmp_root; checks afterwards that each run removed its directory, left no process behind and
    left us unharmed."""
    assert sandbox_backend() == "bwrap"  # fails loudly where bwrap is missing: the Makefile installs it
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    limits, cwd = [resource.getrlimit(r) for r in _LIMITS], os.getcwd()
    sched = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0), os.sched_getscheduler(0))
    before, sandboxed = set(_children()), _in_other_pid_namespaces()
    yield sandboxes
    assert os.listdir(sandboxes) == [], "a sandbox directory was left behind"
    assert [resource.getrlimit(r) for r in _LIMITS] == limits and os.getcwd() == cwd
    assert (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0), os.sched_getscheduler(0)) == sched
    assert set(_children()) - before == set(), "a child process of the test was left behind"
    # Another test process (a second pytest worker) may be running sandboxes of its own, which end within their
    # wall time; one of ours left behind (a daemon sleeping 30 s) would outlive this wait.
    left, deadline = _in_other_pid_namespaces() - sandboxed, time.monotonic() + 5.0
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left &= _in_other_pid_namespaces()
    assert {pid: _command(pid) for pid in left} == {}, "a sandboxed process outlived its run"


def _run(code, root, **kwargs):
    result = run_sandboxed(code, tmp_root=root, **kwargs)
    assert not result.ok or result.reason == "ok"
    return result


def _fn_problem():
    return PythonFn().sample(random.Random(0), 1)


# -- what must keep working ---------------------------------------------------------------------------------------

def test_a_normal_program_runs_and_may_write_in_its_directory(root):
    result = _run("import os, tempfile\n"
                  "open('a.txt', 'w').write('hi')\n"
                  "os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
                  "fd, path = tempfile.mkstemp(); os.write(fd, b'x'); os.close(fd); os.remove(path)\n"
                  "print(open('d/b.txt').read(), os.getcwd() == os.environ['TMPDIR'], os.getuid())", root)
    assert result.ok and result.reason == "ok" and result.returncode == 0
    assert result.stdout.split() == ["hi", "True", "65534"]


def test_the_program_is_an_unprivileged_uid_on_the_host(root):
    """Seen from outside (the host's /proc), the sandboxed interpreter is uid and gid 65534 when we are root (CI),
    whether or not that user can reach the interpreter on the host (issue 43), and never uid 0; it holds no
    capability, its bounding set included."""
    token = f"cedar-uid-{os.getpid()}-{time.monotonic_ns()}"
    code = f"import os, time\nopen({token!r}, 'w').close()\ntime.sleep(1.5)\nprint(os.getuid(), os.geteuid())"
    results = []
    worker = threading.Thread(target=lambda: results.append(_run(code, root)))
    worker.start()
    seen, deadline = {}, time.monotonic() + 10.0
    try:
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
            for pid in _in_other_pid_namespaces():
                try:  # the marker in the sandbox's scratch tmpfs, through its root as the host sees it
                    if os.path.exists(f"/proc/{pid}/root/work/{token}"):
                        with open(f"/proc/{pid}/status") as f:
                            seen = dict(line.split(":", 1) for line in f if ":" in line)
                        break
                except OSError:
                    continue
    finally:
        worker.join()
    assert results[0].ok and results[0].stdout.split() == ["65534", "65534"]
    assert seen, "the sandboxed process was not found from the host"
    uids, gids = seen["Uid"].split(), seen["Gid"].split()
    expected = str(SANDBOX_UID) if os.geteuid() == 0 else str(os.geteuid())
    assert uids == [expected] * 4 and "0" not in uids
    if os.geteuid() == 0:
        assert gids == [str(SANDBOX_UID)] * 4 and seen["Groups"].split() == []
    assert int(seen["CapEff"], 16) == int(seen["CapPrm"], 16) == int(seen["CapBnd"], 16) == 0
    assert int(seen["CapInh"], 16) == int(seen["CapAmb"], 16) == 0


def test_the_standard_library_still_works(root):
    result = _run("import collections, dataclasses, functools, json, math, random, re, sqlite3, threading\n"
                  "Point = collections.namedtuple('Point', 'x y', defaults=[0])\n"
                  "@dataclasses.dataclass\nclass Box:\n    size: int = 2\n"
                  "worker = threading.Thread(target=lambda: None)\nworker.start()\nworker.join()\n"
                  "db = sqlite3.connect('in.db')\ndb.execute('create table t (x)')\ndb.commit()\n"
                  "print(Point(1), Box(), functools.reduce(max, [3, 9]), json.dumps(math.pi > 3), random.random() < 1)",
                  root)
    assert result.ok, result
    assert result.stdout.strip() == "Point(x=1, y=0) Box(size=2) 9 true True"


def test_the_pool_runs_a_batch_in_order(root):
    results = run_many([f"print({i} * {i})" for i in range(6)] + ["import os\nos.fork()"], workers=3, tmp_root=root)
    assert [r.stdout.strip() for r in results[:6]] == [str(i * i) for i in range(6)] and all(r.ok for r in results[:6])
    assert results[6].reason == "blocked: os.fork"
    # Each program gets one CPU, and cannot take more.
    results = run_many(["import os\nprint(len(os.sched_getaffinity(0)))\nos.sched_setaffinity(0, range(64))"] * 2,
                       workers=2, tmp_root=root, guard=False)
    assert [r.stdout.strip() for r in results] == ["1", "1"] and all("PermissionError" in r.stderr for r in results)


def test_score_many_gives_the_same_scores_as_score(root):
    env = PythonFn(workers=2)
    problems = [env.sample(random.Random(seed), 1 + seed % 5) for seed in range(6)]
    responses = [p.worked(effort=100) if i % 2 else "def f(*a):\n    return 0" for i, p in enumerate(problems)]
    responses += [b"not a str", "x" * 30_000]
    problems += problems[:2]
    batch = env.score_many(problems, responses)
    assert batch == [env.score(p, r) for p, r in zip(problems, responses)]
    assert [s.correct for s in batch[:6]] == [False, True] * 3


# -- wall time, memory, disk, threads -----------------------------------------------------------------------------

def test_an_infinite_loop_is_stopped_by_the_wall_time_limit(root):
    start = time.monotonic()
    result = _run("while True:\n    pass", root, timeout_s=1.0)
    assert not result.ok and result.reason == "timeout after 1 s" and result.returncode != 0
    assert result.wall_s < 1.0 + 1.0  # spawn to exit: the limit plus at most a second
    assert time.monotonic() - start < 1.0 + 2.0

    score = PythonFn(timeout_s=0.5).score(_fn_problem(), "def f(x):\n    while True:\n        pass")
    assert not score.correct and score.reward == 0.0 and "timeout" in score.detail


def test_unbounded_allocation_is_stopped(root):
    result = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", root, memory_mb=128)
    assert not result.ok and result.reason == "memory" and result.returncode == BLOCKED_EXIT
    assert "MemoryError" in result.stderr

    score = PythonFn(memory_mb=128).score(_fn_problem(), "x = 'a' * (1 << 34)\ndef f(x):\n    return x * x")
    assert not score.correct and "memory" in score.detail


def test_disk_threads_and_output_are_bounded(root):
    result = _run("open('big', 'wb').write(b'x' * (3 << 20))", root, file_mb=1)
    assert not result.ok and result.reason == "file size limit"
    # The scratch tmpfs is full before any one file reaches its limit.
    result = _run("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))", root, disk_mb=4, file_mb=2)
    assert not result.ok and "No space left on device" in result.stderr
    result = _run("import threading, time\nthreads = []\n"
                  "try:\n    for _ in range(1000):\n"
                  "        threads.append(threading.Thread(target=time.sleep, args=(30,), daemon=True))\n"
                  "        threads[-1].start()\n"
                  "except RuntimeError:\n    print(len(threads), flush=True)\n    import os; os._exit(0)",
                  root, guard=False)
    assert result.ok and 0 < int(result.stdout) < 64
    result = _run("print('y' * 500_000)\nprint('end')", root)
    assert result.ok and len(result.stdout) <= OUTPUT_LIMIT and result.stdout.endswith("end\n")


# -- starting processes, native code, daemons ---------------------------------------------------------------------

# The issue's bypass: a fresh copy of the extension under a name the hook did not know ("-posixsubprocess"
# initialises as _posixsubprocess), its fork_exec called directly (no subprocess.Popen event), for a process in a
# session of its own. Loaded from its file, it raises no import event the hook could see; seccomp refuses the fork.
_HYPHEN_POSIXSUBPROCESS = (
    "import importlib.util as u, glob, os, sys\n"
    "path = glob.glob(os.path.dirname(os.__file__) + '/lib-dynload/_posixsubprocess*.so')[0]\n"
    "mod = u.module_from_spec(u.spec_from_file_location('-posixsubprocess', path))\n"
    "r, w = os.pipe()\n"
    "head = ([sys.executable], [sys.executable.encode()], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True,"
    " True, -1, None, None, None, -1, None)\n"
    "try:\n    pid = mod.fork_exec(*head, False)\nexcept TypeError:  # a Python without allow_vfork\n"
    "    pid = mod.fork_exec(*head)\n"
    "print('started', pid)\n")
# A fresh copy of the extension (no hook replaced its fork_exec), driven through subprocess.
_FRESH_POSIXSUBPROCESS = (
    "import importlib.util as u, subprocess, sys\n"
    "subprocess._fork_exec = u.module_from_spec(u.find_spec('_posixsubprocess')).fork_exec\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n")
_CTYPES = "import ctypes, ctypes.util\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.mark.parametrize("code,event", [
    ("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import subprocess\nsubprocess.Popen(['sleep', '30'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import os\nos.forkpty()", "os.forkpty"),
    ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "_posixsubprocess.fork_exec"),
    ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "os.fork"),
    ("import importlib.util as u\nu.module_from_spec(u.find_spec('_posixsubprocess'))", "import _posixsubprocess"),
    ("import ctypes", "import ctypes"),
])
def test_every_way_to_start_a_process_is_blocked_by_the_hook(root, code, event):
    result = _run(code, root)
    assert not result.ok and result.reason == f"blocked: {event}"




@pytest.mark.parametrize("code", [
    "import os\nos.fork()",
    "import os\nos.posix_spawn('/bin/sh', ['sh'], {})",
    "import subprocess\nsubprocess.Popen(['sleep', '30'], start_new_session=True)",
    _FRESH_POSIXSUBPROCESS,
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
    # A fresh interpreter without the hook (the only program visible) is still inside, under the same filter.
    "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import os; os.fork()'])",
    # Native code: the raw syscalls (fork, clone of a process, clone3, vfork, unshare, mount, setns).
    _CTYPES + "rets = [libc.syscall(n, 17, 0, 0, 0, 0) for n in (57, 56, 58, 272)] + [libc.syscall(435, 0, 0)]\n"
    "rets.append(libc.unshare(0x10000000))\nrets.append(libc.mount(b'none', b'/work', b'tmpfs', 0, None))\n"
    "print(rets, ctypes.get_errno())\nassert all(r == -1 for r in rets)\nraise SystemExit(3)",
    # Native code loaded from a shared object written into the sandbox (a copy of one of the interpreter's).
    "import shutil, glob, importlib.machinery as m, importlib.util as u, os\n"
    "src = glob.glob(os.path.dirname(os.__file__) + '/lib-dynload/_ctypes*.so')[0]\n"
    "shutil.copy(src, '/work/evil.so')\n"
    "loader = m.ExtensionFileLoader('_ctypes', '/work/evil.so')\n"
    "spec = u.spec_from_file_location('_ctypes', '/work/evil.so', loader=loader)\n"
    "u.module_from_spec(spec)\n" + _CTYPES + "import os\nos.setsid()\nassert libc.fork() == -1\nraise SystemExit(3)",
])
def test_without_the_hook_no_process_can_be_started_or_left_behind(root, code):
    result = _run(code, root, guard=False)
    assert not result.ok and result.returncode in (1, 3), result
    if result.returncode == 1:
        assert "PermissionError" in result.stderr or "Operation not permitted" in result.stderr, result.stderr


@pytest.mark.parametrize("guard", [True, False])
def test_the_issues_posixsubprocess_bypass_is_contained(root, guard):
    result = _run(_HYPHEN_POSIXSUBPROCESS, root, guard=guard)
    assert not result.ok and "started" not in result.stdout and "PermissionError" in result.stderr, result


def test_fork_bomb_through_the_scorer(root):
    score = PythonFn().score(_fn_problem(), "import os\nos.fork()\ndef f(x):\n    return x * x")
    assert not score.correct and "blocked: os.fork" in score.detail


def test_the_seccomp_filter_is_well_formed():
    program = filter_program()
    assert len(program) % 8 == 0 and 40 < len(program) // 8 < 200
    assert filter_program("aarch64") != program
    with pytest.raises(ValueError, match="no seccomp syscall table for machine 'mips'"):
        filter_program("mips")


# -- the filesystem -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("code", [
    "open(TARGET, 'w').write('x')",
    "import os\nos.makedirs(os.path.dirname(TARGET), exist_ok=True)\nopen(TARGET, 'w').write('x')",
    "import os\nfd = os.open(os.path.dirname(TARGET), os.O_RDONLY)\n"
    "os.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "open('../../../' + TARGET.rsplit('/', 1)[1], 'w').write('x')",
    "import os\nos.symlink(TARGET, 'link')\nopen('link', 'w').write('x')",
    "import sqlite3\nsqlite3.connect(TARGET).execute('create table t (x)')",
    "import sqlite3\ndb = sqlite3.connect(':memory:')\ndb.execute(f\"ATTACH '{TARGET}' AS x\")\n"
    "db.execute('create table x.t (a)')",
    "import sqlite3\ndb = sqlite3.connect(':memory:')\ndb.execute('create table t (a)')\n"
    "db.execute(f\"VACUUM INTO '{TARGET}'\")",
    "import dbm\ndbm.open(TARGET, 'c')",
    "import os\nos.mknod('node', 0o20600, os.makedev(1, 3))",
    "import os\nos.mkfifo('fifo')",
    "open('/usr/' + TARGET.rsplit('/', 1)[1], 'w')",
    "import os\nos.__file__ and open(os.__file__, 'a').write('# x')",
    "open('/proc/sys/kernel/hostname', 'w').write('pwned')",
    "open('/proc/sys/kernel/core_pattern', 'r+')",
    "open('/proc/self/oom_score_adj', 'w').write('-1000')",
])
def test_writes_outside_the_directory_change_nothing(root, tmp_path, code, guard):
    target = tmp_path / "escape.txt"  # root is tmp_path / "sandboxes", so ../../../escape.txt from its work dir
    result = _run(f"TARGET = {str(target)!r}\n{code}", root, guard=guard)
    assert not result.ok, result
    if guard and result.returncode == BLOCKED_EXIT:
        assert result.reason.startswith("blocked: ")
    assert not target.exists() and not os.path.exists("/usr/escape.txt")
    assert socket.gethostname() != "pwned"


def test_the_scratch_directory_is_the_only_writable_place(root):
    # Every mount point (and /dev/shm, /tmp, the home directory), a file created in each, and memory files.
    result = _run("import os\nwritable = []\n"
                  "points = [line.split()[4] for line in open('/proc/self/mountinfo')]\n"
                  "for d in points + ['/dev/shm', '/tmp', os.path.expanduser('~'), '/usr/lib']:\n"
                  "    try:\n        open(os.path.join(d, 'probe'), 'w').close()\n        writable.append(d)\n"
                  "    except OSError:\n        pass\n"
                  "try:\n    os.memfd_create('m')\n    writable.append('memfd')\nexcept OSError:\n    pass\n"
                  "print(sorted(set(writable)))", root, guard=False)
    assert result.ok and result.stdout.strip() == "['/work']", result


@pytest.mark.parametrize("guard", [True, False])
def test_removing_or_changing_files_outside_changes_nothing(root, tmp_path, guard):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    mtime = victim.stat().st_mtime
    for code in ("os.remove(V)", "os.chmod(V, 0)", "os.utime(V, (0, 0))", "os.truncate(V, 0)",
                 "os.rename(V, 'mine')", "import shutil; shutil.rmtree(os.path.dirname(V))",
                 "os.remove(os.__file__)", "os.chmod(sys.executable, 0)"):
        result = _run(f"import os, sys\nV = {str(victim)!r}\n{code}", root, guard=guard)
        assert not result.ok, (code, result)
    assert victim.read_text() == "keep" and victim.stat().st_mtime == mtime
    assert os.path.exists(os.__file__) and os.access(os.path.realpath(sys.executable), os.X_OK)


# -- the parent and the machine: reading, signals, scheduling, terminals, network ---------------------------------

_SECRET = "cedar-secret-" + os.urandom(8).hex()  # in this process's memory and in a file of the test's


@pytest.mark.parametrize("guard", [True, False])
def test_the_parent_is_invisible(root, tmp_path, guard):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(_SECRET)
    code = (f"import os\nPID, FILE, SECRET = {os.getpid()}, {str(secret_file)!r}, {_SECRET.encode()!r}\n"
            "found, seen = [], sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "for pid in (set(seen) | {PID, os.getppid()}) - {os.getpid()}:\n"
            "    for part in ('mem', 'environ', 'cmdline'):\n"
            "        try:\n"
            "            with open(f'/proc/{pid}/{part}', 'rb') as f:\n"
            "                if part != 'mem':\n"
            "                    found += [pid] * (SECRET in f.read())\n"
            "                    continue\n"
            "                for line in open(f'/proc/{pid}/maps'):\n"
            "                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
            "                    try:\n"
            "                        f.seek(lo); found += [pid] * (SECRET in f.read(min(hi - lo, 1 << 24)))\n"
            "                    except (OSError, ValueError, OverflowError):\n"
            "                        pass\n"
            "        except OSError:\n"
            "            pass\n"
            "for path in (FILE, '/etc/passwd', os.path.dirname(FILE), '/home', '/var'):\n"
            "    print(path, os.path.exists(path))\n"
            "print('found', found, 'seen', seen, 'ppid', os.getppid(), 'top', sorted(os.listdir('/')))\n")
    result = _run(code, root, guard=guard)
    assert result.ok, result
    assert "found [] seen [1] ppid 0 top " in result.stdout  # its own memory aside, nothing holds the secret
    assert " True" not in result.stdout and "tmp" not in result.stdout.rpartition("top")[2]


def test_no_descriptor_leads_outside(root):
    # stdin, stdout, stderr and the status pipe: no directory of the host to open files relative to.
    result = _run("import os, stat\nfds = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))\n"
                  "kinds = []\nfor fd in fds:\n    try:\n        mode = os.fstat(fd).st_mode\n    except OSError:\n"
                  "        continue\n    kinds.append((fd, stat.S_ISDIR(mode), stat.S_ISFIFO(mode)))\nprint(kinds)",
                  root, guard=False)
    kinds = ast.literal_eval(result.stdout)
    assert [fd for fd, _, _ in kinds][:3] == [0, 1, 2] and not any(is_dir for _, is_dir, _ in kinds), kinds
    assert len(kinds) == 4 and kinds[3][2], kinds  # the fourth: the status pipe


@pytest.mark.parametrize("code", [
    "import os, signal\nos.kill(PID, signal.SIGKILL)",
    "import os, signal\nos.killpg(os.getpgid(PID), signal.SIGTERM)",
    "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(PID), signal.SIGKILL)",
    "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)",
    "import os\nos.setpriority(os.PRIO_PROCESS, PID, 19)",
    "import os\nos.sched_setaffinity(PID, {0})",
    "import os\nos.sched_setscheduler(PID, os.SCHED_IDLE, os.sched_param(0))",
    "import os\nos.sched_setaffinity(0, {0})\nos.setpriority(os.PRIO_PROCESS, 0, 19)",
    "import fcntl, termios\nfcntl.ioctl(0, termios.TIOCSTI, b'x')",
    "import fcntl, os, termios\nfcntl.ioctl(os.open('/dev/tty', os.O_RDWR), termios.TIOCSTI, b'x')",
    "import fcntl, os, termios, pty\nm, s = os.openpty()\nfcntl.ioctl(s, termios.TIOCSTI, b'x')",
    "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
])
@pytest.mark.parametrize("guard", [True, False])
def test_other_processes_and_terminals_are_out_of_reach(root, code, guard):
    result = _run(f"PID = {os.getpid()}\n{code}", root, guard=guard)
    assert not result.ok, result
    if guard:
        assert result.reason.startswith("blocked: ") or result.returncode == 1, result


@pytest.mark.parametrize("guard", [True, False])
def test_the_network_is_unreachable(root, guard):
    abstract = f"\0cedar-test-{os.getpid()}"
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        tcp.setblocking(False)
        unix.bind(abstract)
        unix.listen()
        unix.setblocking(False)
        port = tcp.getsockname()[1]
        for code in (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')",
                     f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({abstract!r})\ns.send(b'hi')",
                     "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW)",
                     "import socket\nsocket.getaddrinfo('localhost', 80)"):
            result = _run(code, root, guard=guard)
            assert not result.ok, (code, result)
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            unix.accept()

    score = PythonFn().score(_fn_problem(), "import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not score.correct and "blocked: socket" in score.detail


# -- verdicts and rewards -----------------------------------------------------------------------------------------

_WRITE_OK = "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'ok\\n')\n    except OSError:\n" \
            "        pass\n"


@pytest.mark.parametrize("tail,reason", [
    ("os.fork()", "blocked: os.fork"),
    ("os._exit(113)", "exit 113"),
    ("raise SystemExit(1)", "exit 1"),
    ("os.kill(os.getpid(), 9)", "blocked: os.kill"),
])
def test_a_forged_status_is_not_believed(root, tail, reason):
    result = _run(_WRITE_OK + tail, root)
    assert not result.ok and result.reason == reason


def test_the_expected_outputs_never_enter_the_sandbox(root, monkeypatch):
    sent = []
    real = sandbox_module.run_sandboxed

    def spy(code, **kwargs):
        sent.append(code)
        return real(code, **kwargs)

    monkeypatch.setattr("data.envs.python_fn.run_sandboxed", spy)
    problem = Problem("python_fn", "code", 1, "p", "", {"name": "f", "tests": [[[5], 987_654_321]]})
    # The hostile response searches every file and every process it can see for the expected output.
    hack = ("import os\ndef f(x):\n    for pid in os.listdir('/proc'):\n        try:\n"
            "            data = open(f'/proc/{pid}/cmdline', 'rb').read() + open(f'/proc/{pid}/environ', 'rb').read()\n"
            "        except OSError:\n            continue\n"
            "        needle = str(987654320 + 1)\n"
            "        if needle.encode() in data:\n            return int(needle)\n    return -1\n")
    score = PythonFn().score(problem, hack)
    assert not score.correct and "returned -1, want 987654321" in score.detail
    assert "987654321" not in sent[0] and "[[5]]" in sent[0]


@pytest.mark.parametrize("response", [
    # A results line of its own, then an exit before the harness prints the real one.
    "import json, os\nprint('@@cedar-results@@' + json.dumps([['ok', 0]] * 5))\nos._exit(0)",
    # An object that equals everything cannot cross the JSON channel.
    "class Any:\n    def __eq__(self, other):\n        return True\ndef f(*a):\n    return Any()",
    # Replacing the harness's json.dumps.
    "import json\njson.dumps = lambda *a, **k: '[[\"ok\", 1]]'\ndef f(*a):\n    return 1",
    # A results line too deep to parse.
    "import os\nprint('@@cedar-results@@' + '[' * 100000)\nos._exit(0)",
])
def test_reward_hacks_on_the_scoring_path_earn_nothing(root, response):
    score = PythonFn().score(_fn_problem(), response)
    assert not score.correct and score.reward == 0.0, score


# -- set-up: the refusal and the opt-in -----------------------------------------------------------------------------

def test_without_bwrap_a_code_environment_refuses_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    monkeypatch.delenv(sandbox_module.MODE_VARIABLE, raising=False)
    with pytest.raises(SandboxUnavailable, match="no `bwrap` on PATH.*CEDAR_SANDBOX=inprocess") as info:
        run_sandboxed("pass")
    assert "\n" not in str(info.value)
    with pytest.raises(SandboxUnavailable):  # the scorer does not turn it into a failed answer
        PythonFn().score(_fn_problem(), "def f(x):\n    return x")
    monkeypatch.setenv(sandbox_module.MODE_VARIABLE, "docker")
    with pytest.raises(SandboxUnavailable, match="CEDAR_SANDBOX must be"):
        run_sandboxed("pass")


def test_the_inprocess_opt_in_warns_and_keeps_the_hook(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(sandbox_module.MODE_VARIABLE, "inprocess")
    with caplog.at_level(logging.WARNING, logger="data.envs.sandbox"):
        result = run_sandboxed("print(1)", tmp_root=tmp_path)
    assert result.ok and "WITHOUT OS isolation" in caplog.text
    assert run_sandboxed("import os\nos.fork()", tmp_root=tmp_path).reason == "blocked: os.fork"
    assert run_sandboxed(_WRITE_OK + "os.fork()", tmp_root=tmp_path).reason == "blocked: os.fork"
    problem = _fn_problem()
    assert PythonFn().score(problem, problem.worked(effort=100)).correct


def test_bad_arguments(root):
    for kwargs in ({"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mb": 8}, {"file_mb": 0}, {"disk_mb": 0}):
        with pytest.raises(ValueError):
            run_sandboxed("pass", tmp_root=root, **kwargs)
    with pytest.raises(TypeError):
        run_sandboxed(b"pass", tmp_root=root)
    with pytest.raises(ValueError):
        run_many(["pass"], workers=0)
