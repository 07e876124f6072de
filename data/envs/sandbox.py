"""Run untrusted Python (a model's answer to a code problem) where it can harm neither the trainer nor the machine.

Contract: `run_sandboxed(code)` runs `code` in a fresh interpreter inside a bubblewrap sandbox (namespaces of its
own, no capabilities, uid 65534 on the host too, a read-only view of only the interpreter, a size-limited scratch
tmpfs as its working directory, the seccomp filter of data/envs/seccomp.py, rlimits, and an audit hook as the inner
layer) and returns a `SandboxResult`; nothing the run started outlives it. `ok` only for exit 0; the child's report
of why it stopped is believed only with exit status `BLOCKED_EXIT`. `run_many(codes)` runs a batch in parallel on
the CPU budget, results in order. Where bwrap is missing or cannot make its namespaces, `run_sandboxed` raises
`SandboxUnavailable` (one line naming why), unless CEDAR_SANDBOX=inprocess opts in to the audit hook and rlimits
alone (not a security boundary; a warning at each process's first run).

Design, layers and measurements: docs/environments.md#the-sandbox-dataenvssandboxpy-dataenvsseccomppy
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from data.envs.base import EnvironmentUnavailable
from data.envs.seccomp import filter_program

log = logging.getLogger(__name__)

OUTPUT_LIMIT = 64 * 1024
"""bytes of stdout and of stderr kept (the last ones: a traceback or a final answer is at the end)"""
BLOCKED_EXIT = 113
"""exit status of a child that stopped itself and wrote why on its status pipe (the hook, memory, file size)"""
MODE_VARIABLE = "CEDAR_SANDBOX"
"""environment variable: unset or "bwrap" (the default: bubblewrap, required), "inprocess" (the opt-in fallback)"""
SANDBOX_UID = 65534
"""the sandbox's uid and gid ("nobody")"""
SCRATCH = "/work"
"""the working directory inside the sandbox: a tmpfs of `disk_mb`, gone with the run"""
_STATUS_LIMIT = 4096


class SandboxUnavailable(EnvironmentUnavailable):
    """The sandbox cannot run on this machine (bwrap missing or refused); the message is one line naming why."""


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    """the program ran to the end and exited 0 within every limit"""
    stdout: str
    stderr: str
    reason: str
    """"ok", "timeout after T s", "memory", "blocked: <event> [detail]", "exit N", "signal NAME", ..."""
    returncode: int | None
    """the child's exit status (negative: killed by that signal); None when it could not be started"""
    wall_s: float = 0.0
    """seconds from start to exit"""


def run_sandboxed(
    code: str,
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    tmp_root: str | os.PathLike | None = None,
    file_mb: int = 8,
    disk_mb: int = 32,
    guard: bool = True,
) -> SandboxResult:
    """Run the Python source `code` under the layers above. Its stdout and stderr go to files in a temporary
    directory made under `tmp_root` (the system's default when None) and removed before returning. `disk_mb` bounds
    the scratch tmpfs (bwrap only). `guard=False` leaves out the audit hook, keeping every other layer: only for
    testing those on their own. Raises `SandboxUnavailable` as described above."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for key, value, low in (("memory_mb", memory_mb, 32), ("file_mb", file_mb, 1), ("disk_mb", disk_mb, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    user = _host_user() if sandbox_backend() == "bwrap" else None
    return _run_in_dir(code, tmp_root, float(timeout_s), memory_mb, file_mb, disk_mb, guard, user)


def run_many(codes: list[str], *, workers: int | None = None, **limits) -> list[SandboxResult]:
    """`run_sandboxed(code, **limits)` for each code, at most `workers` at once (None: the CPUs this process may
    use), results in the order of `codes`. The CPU budget is `workers` cores: each worker thread is pinned to one
    of this process's CPUs, and the programs it starts inherit that one-CPU affinity (threads included; the filter
    refuses changing it), so a multi-threaded program cannot spread over the machine."""
    cpus = sorted(os.sched_getaffinity(0))
    workers = len(cpus) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    codes = list(codes)
    if not codes:
        return []
    sandbox_backend()  # resolved (and a refusal raised) once, before the threads
    turn = itertools.count()

    def pin() -> None:  # on Linux, affinity of pid 0 is the calling thread's, and a child inherits it
        os.sched_setaffinity(0, {cpus[next(turn) % len(cpus)]})

    with ThreadPoolExecutor(min(workers, len(codes)), thread_name_prefix="cedar-sandbox", initializer=pin) as pool:
        return list(pool.map(lambda code: run_sandboxed(code, **limits), codes))


def sandbox_backend() -> str:
    """"bwrap" or "inprocess" (CEDAR_SANDBOX=inprocess, with a warning); raises `SandboxUnavailable` in one line
    when the default, bwrap, is missing or cannot make a sandbox here. Checked once per process and setting."""
    return _resolve_backend(os.environ.get(MODE_VARIABLE, ""), shutil.which("bwrap"))


@functools.lru_cache(maxsize=None)
def _resolve_backend(mode: str, bwrap: str | None) -> str:
    opt_in = f"or set {MODE_VARIABLE}=inprocess to run code with the in-process guard alone (not a security boundary)"
    if mode == "inprocess":
        log.warning("%s=inprocess: code environments run programs WITHOUT OS isolation (audit hook and rlimits "
                    "only; not a security boundary against an adversarial policy)", MODE_VARIABLE)
        return "inprocess"
    if mode not in ("", "bwrap"):
        raise SandboxUnavailable(f"{MODE_VARIABLE} must be unset, 'bwrap' or 'inprocess', got {mode!r}")
    if bwrap is None:
        raise SandboxUnavailable("code environments need bubblewrap: no `bwrap` on PATH (apt-get install "
                                 f"bubblewrap), {opt_in}")
    probe = _probe(_host_user())
    if probe.stdout.strip() != "42":
        detail = (probe.stderr.strip().splitlines() or [probe.reason])[-1]
        raise SandboxUnavailable(f"bubblewrap ({bwrap}) cannot make a sandbox here: {detail}; {opt_in}")
    return "bwrap"


def session_processes(sid: int) -> list[int]:
    """Live processes (zombies excluded) whose session or process group is `sid`; [] where /proc is missing."""
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # Fields after the command name, which is in parentheses and may itself contain spaces or ")".
        state, _ppid, pgrp, session = stat[stat.rfind(b")") + 2 :].split()[:4]
        if state not in (b"Z", b"X") and sid in (int(pgrp), int(session)):
            found.append(int(name))
    return found


def _probe(user: dict) -> SandboxResult:
    return _run_in_dir("print(6 * 7)", None, 10.0, 64, 1, 1, True, user)


def _run_in_dir(code, tmp_root, timeout_s, memory_mb, file_mb, disk_mb, guard, user) -> SandboxResult:
    """`user`: None for the in-process mode, else Popen's arguments for bwrap's user (see _host_user)."""
    top = tempfile.mkdtemp(prefix="cedar-sandbox-", dir=tmp_root)
    try:
        return _run(code, top, timeout_s, memory_mb, file_mb, disk_mb, guard, user)
    finally:
        _remove(top)


def _run(code: str, top: str, timeout_s: float, memory_mb: int, file_mb: int, disk_mb: int, guard: bool,
         user: dict | None) -> SandboxResult:
    isolated = user is not None
    code_path, out_path, err_path = (os.path.join(top, n) for n in ("code.py", "out", "err"))
    with open(code_path, "wb") as f:
        f.write(code.encode("utf-8", "surrogatepass"))  # lone surrogates reach the child as a SyntaxError
    cpu_s = math.ceil(timeout_s) + 1  # a backstop: the wall-time limit normally fires first
    # Threads count as processes for RLIMIT_NPROC; inside bwrap, seccomp refuses every other new process. Without a
    # user namespace (_setpriv) the count is every task of uid SANDBOX_UID on the host, so concurrent runs share it.
    drop = isolated and _drops_to_nobody(user)
    nproc = (32 * (os.cpu_count() or 1) if drop else 32) if isolated else 0
    fds: list[int] = []
    try:
        code_fd = os.open(code_path, os.O_RDONLY | os.O_CLOEXEC)
        fds.append(code_fd)
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        os.set_blocking(status_r, False)
        child = ["-I", "-S", "-B", "-c", _LAUNCH, _CHILD, str(status_w), str(code_fd), str(int(guard)),
                 str(memory_mb << 20), str(cpu_s), str(file_mb << 20), str(nproc)]
        if isolated:
            seccomp_r, seccomp_w = os.pipe()
            fds.append(seccomp_r)
            os.write(seccomp_w, filter_program())  # ~700 bytes: within the pipe's buffer
            os.close(seccomp_w)
            info_r, info_w = os.pipe()
            fds += [info_r, info_w]
            argv = _bwrap_argv(seccomp_r, info_w, disk_mb, drop) + child
            cwd, home = "/", SCRATCH
            pass_fds = (code_fd, status_w, seccomp_r, info_w)
        else:
            cwd = home = os.path.realpath(os.path.join(top, "work"))  # the hook compares paths with this prefix
            os.mkdir(cwd, 0o700)
            argv = [sys.executable] + child
            pass_fds = (code_fd, status_w)
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            start = time.monotonic()
            try:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        pass_fds=pass_fds, start_new_session=True, **(user or {}))
            except OSError as e:
                return SandboxResult(False, "", str(e), f"spawn failed: {e}", None)
            finally:  # the child holds its own copies now
                for fd in pass_fds[1:]:
                    os.close(fd)
                    fds.remove(fd)
            init = _sandbox_init(info_r, start + timeout_s) if isolated else None
            try:
                finished = _wait_exited(proc.pid, start + timeout_s)
            finally:
                _end(proc, init)
            wall_s = time.monotonic() - start
        try:
            status = os.read(status_r, _STATUS_LIMIT).decode("utf-8", "replace")
        except BlockingIOError:  # nothing written
            status = ""
    finally:
        for fd in fds:
            os.close(fd)
    stdout, stderr = _tail(out_path), _tail(err_path)
    reason = _reason(finished, status, proc.returncode, timeout_s)
    return SandboxResult(reason == "ok", stdout, stderr, reason, proc.returncode, wall_s)


def _sandbox_init(info_fd: int, deadline: float) -> int | None:
    """A pidfd of bwrap's child, the init of the sandbox's PID namespace (the interpreter), from the JSON that bwrap
    writes on its info fd (None when bwrap failed before writing it). The pidfd is opened while bwrap, its parent,
    has not reaped it, so the pid cannot have been reused."""
    data = b""
    while not data.endswith(b"}\n") and select.select([info_fd], [], [], max(deadline - time.monotonic(), 0))[0]:
        chunk = os.read(info_fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return os.pidfd_open(int(json.loads(data)["child-pid"]))
    except (ValueError, KeyError, TypeError, OSError):
        return None


def _end(proc: subprocess.Popen, init: int | None) -> None:
    """Kill whatever is left of a run and reap it. The leader is still unreaped here, so its pid and group id
    cannot have been reused by another process."""
    if init is None:
        _kill_session(proc.pid)
    else:
        # The sandbox's init first (bwrap --as-pid-1: the interpreter): every process of its namespace dies with it,
        # its pidfd turns readable only once they all have, and bwrap, its parent, reaps it (no orphan is left
        # to a host init that might not reap).
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        except OSError:  # exited already
            pass
        select.select([init], [], [], 10.0)
        os.close(init)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap itself, should it linger
        except OSError:
            pass
    proc.wait()


@functools.lru_cache(maxsize=1)
def _host_user() -> dict:
    """Popen's arguments that run bwrap as SANDBOX_UID, when we are root and that user can reach the interpreter:
    the sandbox's uid is then unprivileged on the host too. Otherwise ({}) bwrap runs as we do: not as root, it maps
    the sandbox's uid to ours; as root, it makes no user namespace and setpriv drops to host uid SANDBOX_UID
    (_drops_to_nobody). Where unprivileged user namespaces are refused (Ubuntu's AppArmor restriction), bwrap runs
    as root too."""
    if os.geteuid() != 0:
        return {}
    exe = os.path.realpath(sys.executable)
    needed = [exe, os.path.dirname(os.path.realpath(os.__file__))]
    for path in needed:
        parts = path.split("/")
        for i in range(2, len(parts)):
            if not os.stat("/".join(parts[:i])).st_mode & 0o001:  # a directory others cannot search
                return {}
        if not os.stat(path).st_mode & 0o004:
            return {}
    nobody = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
    return nobody if _probe(nobody).stdout.strip() == "42" else {}


def _drops_to_nobody(user: dict) -> bool:
    """Whether bwrap runs as root (`user` {}: SANDBOX_UID cannot reach the interpreter on the host) without a user
    namespace, keeping only CAP_SETUID, CAP_SETGID and CAP_SETPCAP, and starts the interpreter through `setpriv`,
    which takes the process to host uid and gid SANDBOX_UID with no groups and empty capability sets (bounding set
    included). The interpreter's directories are reachable there: bwrap makes their parents (0755) in its tmpfs
    root. Without setpriv (util-linux) the sandbox keeps the mapped root of a user namespace."""
    return not user and os.geteuid() == 0 and _setpriv() is not None


@functools.lru_cache(maxsize=1)
def _setpriv() -> str | None:
    found = shutil.which("setpriv", path="/usr/bin:/bin")
    return os.path.realpath(found) if found else None


@functools.lru_cache(maxsize=None)
def _interpreter_view(drop: bool = False) -> tuple[str, ...]:
    """bwrap arguments that show the interpreter, read-only, at its own paths: the binary, the standard library
    (site-packages hidden) and the shared objects that the binary and lib-dynload's modules load (from `ldd`; Tk's
    module and its X11 libraries left out). Each shared object is bound at the path the loader asks for (its
    soname), so no symlink is needed: a mount each costs ~0.3 ms of every run's start."""
    exe = os.path.realpath(sys.executable)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("the sandbox needs `ldd` (Debian package libc-bin) to list the interpreter's "
                                 f"shared objects; or set {MODE_VARIABLE}=inprocess")
    modules = [path for path in sorted(glob.glob(os.path.join(stdlib, "lib-dynload", "*.so")))
               if not os.path.basename(path).startswith("_tkinter")]
    extra = [_setpriv()] if drop else []
    listing = subprocess.run([ldd, exe, *modules, *extra], capture_output=True, text=True,
                             env={"LC_ALL": "C"}).stdout
    shown = {exe, *extra}
    for line in listing.splitlines():
        path = line.strip().rpartition(" => ")[2].partition(" (")[0]
        if path.startswith("/") and os.path.isfile(path):
            shown.add(path)
    args = []
    for name in ("lib", "lib32", "lib64", "libx32", "bin", "sbin"):  # merged-/usr symlinks, kept as they are
        if os.path.islink("/" + name):
            args += ["--symlink", os.readlink("/" + name), "/" + name]
    bound = set()
    for path in sorted(shown):
        seen = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if seen not in bound:
            bound.add(seen)
            args += ["--ro-bind", os.path.realpath(path), seen]
    args += ["--ro-bind", stdlib, stdlib]
    if drop:  # bwrap as root makes a bind's missing parents as private as the host's (/root: 0700)
        parents = set()
        for target in (*bound, stdlib):
            parts = target.split("/")
            parents.update("/".join(parts[:i]) for i in range(2, len(parts)))
        made = []
        for parent in sorted(parents):
            made += ["--perms", "0755", "--dir", parent]
        args = made + args
    hidden = os.path.join(stdlib, "site-packages")
    if os.path.isdir(hidden):
        args += ["--tmpfs", hidden, "--remount-ro", hidden]  # a tmpfs is writable, and sized by half the RAM
    if os.path.isdir("/usr/lib/locale/C.utf8"):
        args += ["--ro-bind", "/usr/lib/locale/C.utf8", "/usr/lib/locale/C.utf8"]
    return tuple(args)


@functools.lru_cache(maxsize=1)
def _bwrap_extra() -> tuple[str, ...]:
    """Options of newer bwraps (0.8: --disable-userns; seccomp refuses new namespaces anyway), where supported."""
    usage = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, text=True).stdout
    return ("--disable-userns",) if "--disable-userns" in usage else ()


def _bwrap_argv(seccomp_fd: int, info_fd: int, disk_mb: int, drop: bool = False) -> list[str]:
    """`drop`: no user namespace, setpriv takes the interpreter to host uid SANDBOX_UID (see _drops_to_nobody); the
    filter is in force from setpriv on and allows its calls (setres[ug]id, setgroups, capset, prctl)."""
    if drop:
        user = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        scratch = "0777"  # the tmpfs belongs to root
        start = [_setpriv(), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--"]
    else:
        user = ["--unshare-user", *_bwrap_extra(), "--cap-drop", "ALL",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        scratch, start = "0700", []
    return [shutil.which("bwrap") or "bwrap",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--as-pid-1", "--die-with-parent", "--new-session", *user, "--hostname", "sandbox",
            *_interpreter_view(drop),
            # procfs read-only: in a user namespace made as root, the sandbox's uid is host uid 0 to the kernel's
            # own checks, and some /proc files (sysctls, sysrq-trigger) check nothing else.
            "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--remount-ro", "/dev",  # no /dev/shm
            "--size", str(disk_mb << 20), "--perms", scratch, "--tmpfs", SCRATCH, "--chdir", SCRATCH,
            "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd),
            "--", *start, os.path.realpath(sys.executable)]


def _wait_exited(pid: int, deadline: float) -> bool:
    """Wait until child `pid` has exited or `deadline` (monotonic) has passed, without reaping it."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll instead
        return _poll_exited(pid, deadline)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # a pidfd turns readable when its process exits
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if poller.poll(math.ceil(remaining * 1000)):
                return True
    finally:
        os.close(pidfd)


def _poll_exited(pid: int, deadline: float) -> bool:
    delay = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, 0.02)


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    # Processes that moved to another group of the same session; one that started a session of its own would
    # escape, but making one needs a process start, which the hook refuses (in-process mode only: bwrap's PID
    # namespace holds them all).
    for pid in session_processes(sid):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _reason(finished: bool, status: str, returncode: int, timeout_s: float) -> str:
    """The verdict: the status pipe is the program's to write too, so it is read only for BLOCKED_EXIT (its last
    line, never "ok"), and "ok" is exit 0 alone."""
    if not finished:
        return f"timeout after {timeout_s:g} s"
    if returncode == 0:
        return "ok"
    if returncode == BLOCKED_EXIT:
        lines = [line.strip() for line in status.splitlines() if line.strip()]
        if lines and lines[-1] != "ok":
            return lines[-1][:200]
    if returncode < 0:
        names = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit"}
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"signal {-returncode}"
        return names.get(sig, f"signal {sig.name}")
    return f"exit {returncode}"


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - OUTPUT_LIMIT))
        return f.read(OUTPUT_LIMIT).decode("utf-8", "replace")


def _remove(path: str) -> None:
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    # The code may have taken the permissions off its own directories (which stops a non-root rmtree).
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            try:
                os.chmod(os.path.join(dirpath, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


# The child's bootstrap, run with `python -I -S -B -c`: kept to modules that are built in or cheap to load, so a
# run starts in ~10 ms. It is compiled under a file name of its own (the hook knows its functions by it) and takes
# the arguments: status fd (write end of a pipe), code fd, guard (0/1), address-space bytes, CPU seconds, file
# bytes, processes (threads included).
#
# The hook runs on every audit event of the untrusted code, so it must not depend on anything that code can
# change: every name it uses is a default argument bound at definition (builtins and module attributes can be
# replaced, a function's defaults only through `object.__setattr__`, which the hook refuses), its tables are
# immutable, and any error inside it stops the child rather than escaping with a traceback into the hook's frame.
_GUARD_FILE = "<cedar-guard>"
_LAUNCH = f"import sys; exec(compile(sys.argv[1], {_GUARD_FILE!r}, 'exec'))"
_CHILD = r'''
import errno, posix, resource, sys
import _posixsubprocess  # cached now, so the guarded code's import gets this module, with fork_exec replaced

BLOCKED_EXIT = %(blocked_exit)d
BLOCKED = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.startfile",
    "subprocess.Popen", "cpython.PyInterpreterState_New",
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
    "ctypes.string_at", "ctypes.wstring_at",
    "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
    "os.chdir", "os.symlink", "os.link", "os.setxattr", "os.removexattr",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
    "sys._current_frames", "syslog.openlog", "syslog.syslog",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
})
BLOCKED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_xxinterpchannels", "_testcapi",
    "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase", "_testimportmultiple",
    "_testclinic", "_xxtestfuzz",
    # These write files from C, where no audit event sees the path: dbm files, shared memory and semaphores,
    # readline history, sound devices.
    "_dbm", "_gdbm", "_posixshmem", "_multiprocessing", "readline", "ossaudiodev",
})
# Unaudited functions that create files; replaced by refusals (a speed bump only: see docs/environments.md).
REFUSED_FUNCTIONS = ("mknod", "mkfifo")
# event -> ((index of a path argument, index of its dir_fd argument or -1), ...)
PATH_EVENTS = (
    ("os.remove", ((0, 1),)), ("os.rmdir", ((0, 1),)), ("os.mkdir", ((0, 2),)), ("os.rename", ((0, 2), (1, 3))),
    ("os.truncate", ((0, -1),)), ("os.chmod", ((0, 2),)), ("os.chown", ((0, 3),)), ("os.utime", ((0, 3),)),
    ("shutil.rmtree", ((0, 1),)),
)
GUARD_FILE = %(guard_file)r
WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC


def limit(kind, soft, hard=None):
    # Never above the hard limit already in force (only root could raise it).
    _, current = resource.getrlimit(kind)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


def install_guard(root, status):
    def stop(what, _write=posix.write, _exit=posix._exit, _status=status, _code=BLOCKED_EXIT):
        try:
            _write(_status, ("blocked: " + what + "\n").encode("utf-8", "replace"))
        finally:
            _exit(_code)

    def where(path, dir_fd, _getcwd=posix.getcwd, _readlink=posix.readlink, _type=type, _str=str, _bytes=bytes,
              _int=int):
        """The absolute path that a path argument names; None when it cannot be told or climbs with "..",
        which a symlink above it could turn anywhere."""
        if _type(path) is _int:  # a file descriptor: pipes and sockets have no path, and are refused
            path = _readlink("/proc/self/fd/%%d" %% path)
            if not path.startswith("/"):
                return None
        if _type(path) is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        if _type(path) is not _str:
            return None
        if not path.startswith("/"):
            if dir_fd is None or dir_fd == -1:  # -1: the event's "no dir_fd"
                base = _getcwd()
            elif _type(dir_fd) is _int and dir_fd >= 0:
                base = _readlink("/proc/self/fd/%%d" %% dir_fd)
            else:
                return None
            path = base + "/" + path
        parts = [part for part in path.split("/") if part and part != "."]
        if ".." in parts:
            return None
        return "/" + "/".join(parts)

    def hook(event, args, _stop=stop, _where=where, _inside=root + "/", _blocked=BLOCKED,
             _imports=BLOCKED_IMPORTS, _paths=PATH_EVENTS, _write_flags=WRITE_FLAGS, _stat=posix.stat,
             _missing=FileNotFoundError, _any=BaseException, _type=type, _int=int, _str=str, _bytes=bytes,
             _function=type(limit), _guard_file=GUARD_FILE):
        try:
            if event in _blocked:
                _stop(event)
            elif event == "import":
                name = args[0]
                # The last part too: an extension loaded as "pkg._ctypes" still initialises as _ctypes.
                if _type(name) is not _str or name.partition(".")[0] in _imports or name.rpartition(".")[2] in _imports:
                    _stop("import " + (name if _type(name) is _str else "of a non-str name"))
            elif event == "open":
                path, mode, flags = args
                if _type(flags) is not _int or not flags & _write_flags or (mode is not None and _type(path) is _int):
                    return  # a read, or open() on a descriptor already open (and checked) for writing
                # os.open (mode None) does not put its dir_fd in the event, so only an absolute path can be checked.
                relative = _type(path) is _str and path[:1] != "/" or _type(path) is _bytes and path[:1] != b"/"
                if mode is None and relative:
                    _stop("open of a relative path by os.open")
                target = _where(path, None)
                if target == "/dev/null":
                    return
                if target is None or not target.startswith(_inside):
                    _stop("open for writing outside the sandbox: " + (target or "(unresolved path)"))
                try:
                    kind = _stat(target).st_mode & 0o170000
                except _missing:
                    return
                if kind != 0o100000:  # device nodes (mknod is not audited) and fifos
                    _stop("open of a non-regular file: " + target)
            elif event == "sqlite3.connect":
                database = args[0]
                if database != ":memory:" and database != "":
                    target = _where(database, None)  # a "file:" URI stays relative, so it lands in the check below
                    if target is None or not target.startswith(_inside) or "file:" in target:
                        _stop("sqlite3.connect outside the sandbox: " + (target or "(unresolved path)"))
            elif event == "object.__setattr__" or event == "object.__delattr__":
                # Only a function's __code__, __defaults__ and __kwdefaults__ raise these; the stdlib sets
                # defaults of its own functions (namedtuple), so refuse only changes to the guard's.
                if _type(args[0]) is _function and args[0].__code__.co_filename == _guard_file:
                    _stop("changing the guard's functions")
            else:
                for name, specs in _paths:
                    if name == event:
                        for index, fd_index in specs:
                            target = _where(args[index], None if fd_index < 0 else args[fd_index])
                            if target is None or not target.startswith(_inside):
                                _stop(event + " outside the sandbox: " + (target or "(unresolved path)"))
                        return
        except _any:
            _stop("unreadable arguments to " + event)

    def fork_exec(*args, _stop=stop):
        _stop("_posixsubprocess.fork_exec")

    def refusal(name):
        def refused(*args, _stop=stop, _name=name, **kwargs):
            _stop(_name)
        return refused

    _posixsubprocess.fork_exec = fork_exec
    for name in REFUSED_FUNCTIONS:
        for module in (posix, sys.modules.get("os")):
            if module is not None and hasattr(module, name):
                setattr(module, name, refusal("os." + name))
    sys.addaudithook(hook)


def main(status_fd, code_fd, guard, memory, cpu, fsize, nproc):
    status, code = int(status_fd), int(code_fd)
    chunks = []
    while True:
        chunk = posix.read(code, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    posix.close(code)
    source = b"".join(chunks)
    limit(resource.RLIMIT_AS, int(memory))
    limit(resource.RLIMIT_FSIZE, int(fsize))
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_NPROC, int(nproc))
    limit(resource.RLIMIT_CPU, int(cpu), int(cpu) + 1)  # SIGXCPU at the soft limit, SIGKILL at the hard one
    sys.argv = ["program.py"]
    if guard == "1":
        install_guard(posix.getcwd(), status)
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return
    except MemoryError as e:
        reason, error = b"memory\n", e
    except OSError as e:
        if e.errno != errno.EFBIG:  # Python ignores SIGXFSZ, so RLIMIT_FSIZE shows up as this error
            raise
        reason, error = b"file size limit\n", e
    # The reason is believed only with BLOCKED_EXIT (the code can write on the status pipe too).
    try:
        sys.excepthook(type(error), error, error.__traceback__)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        posix.write(status, reason)
        posix._exit(BLOCKED_EXIT)


main(*sys.argv[2:])
''' % {"blocked_exit": BLOCKED_EXIT, "guard_file": _GUARD_FILE}
