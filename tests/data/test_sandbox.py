"""The sandbox (data/envs/sandbox.py) stops each kind of harmful program and reports it as failed with the right
reason: an endless loop (wall time), unbounded allocation (memory), fork and a fork bomb (no process of its session
survives), every other way to start a process, sockets (nothing reaches a listener of ours), writes outside its
directory (the file does not appear), killing the parent, oversized files. Writing inside its own directory works,
the directory is removed afterwards, and the test process itself is unharmed: same limits, same working
directory, no child left behind. A few cases also go through python_fn's scorer, as the RL trainer would."""

import os
import random
import resource
import signal
import socket
import time

import pytest

from data.envs.python_fn import PythonFn
from data.envs.sandbox import OUTPUT_LIMIT, run_sandboxed, session_processes

_LIMITS = [resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NPROC,
           resource.RLIMIT_NOFILE]


def _children():
    """Processes whose parent is this test process, zombies included."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        if int(stat[stat.rfind(b")") + 2 :].split()[1]) == os.getpid():
            found.append(int(name))
    return found


@pytest.fixture
def root(tmp_path):
    """The sandboxes' tmp_root; checks afterwards that each run removed its directory and left us unharmed."""
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    limits, cwd = [resource.getrlimit(r) for r in _LIMITS], os.getcwd()
    before = set(_children())  # earlier tests' long-lived helpers (a multiprocessing forkserver) are not ours
    yield sandboxes
    assert os.listdir(sandboxes) == [], "a sandbox directory was left behind"
    assert [resource.getrlimit(r) for r in _LIMITS] == limits and os.getcwd() == cwd
    assert set(_children()) - before == set(), "a child process of the test was left behind"


def _run(code, root, **kwargs):
    result = run_sandboxed(code, tmp_root=root, **kwargs)
    assert not result.ok or result.reason == "ok"
    return result


def _fn_problem():
    return PythonFn().sample(random.Random(0), 1)


def test_a_normal_program_runs_and_may_write_in_its_directory(root):
    result = _run("import os, tempfile\n"
                  "open('a.txt', 'w').write('hi')\n"
                  "os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
                  "fd, path = tempfile.mkstemp(); os.write(fd, b'x'); os.close(fd); os.remove(path)\n"
                  "print(open('d/b.txt').read(), os.getcwd().startswith(os.environ['TMPDIR']))", root)
    assert result.ok and result.reason == "ok" and result.returncode == 0
    assert result.stdout.split() == ["hi", "True"]


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


def test_an_infinite_loop_is_stopped_by_the_wall_time_limit(root):
    start = time.monotonic()
    result = _run("while True:\n    pass", root, timeout_s=1.0)
    assert not result.ok and result.reason == "timeout after 1 s" and result.returncode == -signal.SIGKILL
    assert result.wall_s < 1.0 + 1.0  # spawn to exit: the limit plus at most a second
    assert time.monotonic() - start < 1.0 + 2.0  # and the directory's removal, with slack for a loaded CI machine

    env = PythonFn(timeout_s=0.5)
    problem = _fn_problem()
    score = env.score(problem, "def f(x):\n    while True:\n        pass")
    assert not score.correct and score.reward == 0.0 and "timeout" in score.detail


def test_unbounded_allocation_is_stopped(root):
    result = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", root, memory_mb=128)
    assert not result.ok and result.reason == "memory"
    assert "MemoryError" in result.stderr

    env = PythonFn(memory_mb=128)
    score = env.score(_fn_problem(), "x = 'a' * (1 << 34)\ndef f(x):\n    return x * x")
    assert not score.correct and "memory" in score.detail


def test_fork_and_a_fork_bomb_are_stopped_and_leave_no_process(root):
    result = _run("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()", root)
    assert not result.ok and result.reason == "blocked: os.fork" and result.returncode != 0
    assert session_processes(int(result.stdout)) == []

    score = PythonFn().score(_fn_problem(), "import os\nos.fork()\ndef f(x):\n    return x * x")
    assert not score.correct and "blocked: os.fork" in score.detail


@pytest.mark.parametrize("code,event", [
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import subprocess\nsubprocess.Popen(['sleep', '30'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import os\nos.forkpty()", "os.forkpty"),
    ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "_posixsubprocess.fork_exec"),
    ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "os.fork"),
    ("import importlib.util as u\nu.module_from_spec(u.find_spec('_posixsubprocess'))", "import _posixsubprocess"),
])
def test_every_way_to_start_a_process_is_blocked(root, code, event):
    result = _run(code, root)
    assert not result.ok and result.reason == f"blocked: {event}"


def test_children_are_killed_even_without_the_audit_hook(root):
    # Only the resource limits and the process-group cleanup: a child left sleeping must not survive the run.
    result = _run("import os, time\n"
                  "try:\n    pid = os.fork()\nexcept OSError:\n    print('refused')\n    raise SystemExit\n"
                  "if pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
                  "print(pid)", root, guard=False)
    if result.stdout.strip() == "refused":  # RLIMIT_NPROC applied (not root): no child to clean up
        return
    pid = int(result.stdout)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.01)
    assert not _alive(pid), "the sandbox's child survived it"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def test_sockets_are_blocked(root):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = _run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')", root)
        assert not result.ok and result.reason == "blocked: socket.__new__"
        with pytest.raises(BlockingIOError):
            listener.accept()
    result = _run("import socket\nsocket.getaddrinfo('localhost', 80)", root)
    assert result.reason == "blocked: socket.getaddrinfo"

    score = PythonFn().score(_fn_problem(), "import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not score.correct and "blocked: socket" in score.detail


@pytest.mark.parametrize("code", [
    "open(TARGET, 'w').write('x')",
    "open(TARGET, 'a').write('x')",
    "import os\nos.open(TARGET, os.O_WRONLY | os.O_CREAT)",
    "import pathlib\npathlib.Path(TARGET).write_text('x')",
    "import os\nos.mkdir(TARGET)",
    "open('x', 'w').close()\nimport os\nos.rename('x', TARGET)",
    "import shutil\nopen('x', 'w').close()\nshutil.copy('x', TARGET)",
    "import os\nos.symlink(TARGET, 'link')\nopen('link', 'w').write('x')",
    "open('../../../' + TARGET.rsplit('/', 1)[1], 'w').write('x')",
    "import os\nos.chdir(os.path.dirname(TARGET))\nopen('escape.txt', 'w').write('x')",
    "import os\nfd = os.open(os.path.dirname(TARGET), os.O_RDONLY)\n"
    "os.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "import os\nos.mknod(TARGET)",
    "import os\nos.mkfifo(TARGET)",
    "import sqlite3\nsqlite3.connect(TARGET).execute('create table t (x)')",
    "import dbm\ndbm.open(TARGET, 'c')",
])
def test_writes_outside_the_directory_are_blocked(root, tmp_path, code):
    target = tmp_path / "escape.txt"  # root is tmp_path / "sandboxes", so ../../../escape.txt from its work dir
    result = _run(f"TARGET = {str(target)!r}\n{code}", root)
    assert not result.ok and result.reason.startswith("blocked: "), result
    assert not target.exists()


def test_removing_or_changing_files_outside_is_blocked(root, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for code in ("os.remove(V)", "os.chmod(V, 0)", "os.utime(V, (0, 0))", "os.truncate(V, 0)",
                 "os.rename(V, 'mine')", "import shutil; shutil.rmtree(os.path.dirname(V))"):
        result = _run(f"import os\nV = {str(victim)!r}\n{code}", root)
        assert result.reason.startswith("blocked: "), (code, result)
    assert victim.read_text() == "keep" and victim.stat().st_mtime > 0


@pytest.mark.parametrize("code,reason", [
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "blocked: os.kill"),
    ("import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGTERM)", "blocked: os.killpg"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "blocked: resource.setrlimit"),
    ("import ctypes", "blocked: import ctypes"),
    ("import gc\ngc.get_objects()", "blocked: gc.get_objects"),
])
def test_attacks_on_the_parent_or_the_limits_are_blocked(root, code, reason):
    result = _run(code, root)
    assert not result.ok and result.reason == reason


def test_file_size_and_output_are_capped(root):
    result = _run("open('big', 'wb').write(b'x' * (3 << 20))", root, file_mb=1)
    assert not result.ok and result.reason == "file size limit"
    result = _run("print('y' * 500_000)\nprint('end')", root)
    assert result.ok and len(result.stdout) <= OUTPUT_LIMIT and result.stdout.endswith("end\n")


def test_bad_arguments(root):
    for kwargs in ({"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mb": 8}, {"file_mb": 0}):
        with pytest.raises(ValueError):
            run_sandboxed("pass", tmp_root=root, **kwargs)
    with pytest.raises(TypeError):
        run_sandboxed(b"pass", tmp_root=root)
