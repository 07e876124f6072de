"""Run untrusted Python (a model's answer to a code problem) in a child process that cannot harm the trainer.

`run_sandboxed(code)` runs `code` in a fresh interpreter (`python -I -S -B`: no site-packages, no environment
variables, no bytecode written) whose working directory is a new temporary directory, removed afterwards. Layers:

- wall time: the parent waits `timeout_s`, then kills the child's whole process group (it is started in a session
  of its own); after every run, finished or not, anything left in that group or session is killed too;
- resource limits, set by the child on itself before the code runs: address space (`memory_mb`), CPU seconds,
  size of any file written (`file_mb`, which also bounds stdout and stderr), no core dumps, 64 open files, no new
  processes (RLIMIT_NPROC; the kernel does not apply it to root);
- an audit hook (PEP 578), installed before the code runs, that ends the child at the first forbidden act: any
  way to start a process (fork, exec, spawn, system, subprocess, a fresh copy of _posixsubprocess), any socket or
  name lookup, ctypes and the C test modules, signals to other processes, raising resource limits, chdir, links,
  writes, removals and metadata changes of paths outside the directory, and the introspection that would reach the
  hook itself (gc referents, tracing, replacing a function's code or defaults).

A stopped run is reported in `SandboxResult.reason`: "ok", "timeout after 2 s", "memory", "blocked: os.fork",
"cpu time limit", "file size limit", "exit 1", "signal SIGSEGV", ... The hook is a guard against accidents and
ordinary Python, not a security boundary against native code or an adversary: see docs/environments.md.
"""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

OUTPUT_LIMIT = 64 * 1024
"""bytes of stdout and of stderr kept (the last ones: a traceback or a final answer is at the end)"""
BLOCKED_EXIT = 113
"""exit status of a child stopped by the audit hook (the reason itself is written to the status file)"""


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
    guard: bool = True,
) -> SandboxResult:
    """Run the Python source `code` under the limits above, in a temporary directory made under `tmp_root` (the
    system's default when None) and removed before returning. `guard=False` leaves out the audit hook, keeping the
    resource limits and the process-group cleanup: only for testing those layers on their own."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for key, value, low in (("memory_mb", memory_mb, 32), ("file_mb", file_mb, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    top = tempfile.mkdtemp(prefix="cedar-sandbox-", dir=tmp_root)
    try:
        return _run(code, top, float(timeout_s), memory_mb, file_mb, guard)
    finally:
        _remove(top)


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


def _run(code: str, top: str, timeout_s: float, memory_mb: int, file_mb: int, guard: bool) -> SandboxResult:
    work = os.path.join(top, "work")
    os.mkdir(work, 0o700)
    work = os.path.realpath(work)  # the hook compares paths with this prefix, so no symlink may be above it
    code_path, out_path, err_path, status_path = (os.path.join(top, n) for n in ("code.py", "out", "err", "status"))
    with open(code_path, "wb") as f:
        f.write(code.encode("utf-8", "surrogatepass"))  # lone surrogates reach the child as a SyntaxError
    open(status_path, "wb").close()
    cpu_s = math.ceil(timeout_s) + 1  # a backstop: the wall-time limit normally fires first
    argv = [sys.executable, "-I", "-S", "-B", "-c", _LAUNCH, _CHILD, status_path, code_path, str(int(guard)),
            str(memory_mb << 20), str(cpu_s), str(file_mb << 20)]
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    close_fds=True, start_new_session=True)
        except OSError as e:
            return SandboxResult(False, "", str(e), f"spawn failed: {e}", None)
        try:
            finished = _wait_exited(proc.pid, start + timeout_s)
        finally:
            # The leader is still unreaped here, so its group id cannot have been reused by another process.
            _kill_session(proc.pid)
            proc.wait()
        wall_s = time.monotonic() - start
    with open(status_path, "rb") as f:
        status = f.read(4096).decode("utf-8", "replace").strip()
    stdout, stderr = _tail(out_path), _tail(err_path)
    reason = _reason(finished, status, proc.returncode, timeout_s)
    return SandboxResult(reason == "ok", stdout, stderr, reason, proc.returncode, wall_s)


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
    # escape, but making one needs a process start, which the hook refuses.
    for pid in session_processes(sid):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _reason(finished: bool, status: str, returncode: int, timeout_s: float) -> str:
    if not finished:
        return f"timeout after {timeout_s:g} s"
    if status:
        return status.splitlines()[0]
    if returncode < 0:
        names = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit"}
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"signal {-returncode}"
        return names.get(sig, f"signal {sig.name}")
    return "ok" if returncode == 0 else f"exit {returncode}"


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
# the arguments: status path, code path, guard (0/1), address-space bytes, CPU seconds, file bytes.
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


def main(status_path, code_path, guard, memory, cpu, fsize):
    status = posix.open(status_path, posix.O_WRONLY | posix.O_APPEND)
    with open(code_path, "rb") as f:
        source = f.read()
    limit(resource.RLIMIT_AS, int(memory))
    limit(resource.RLIMIT_FSIZE, int(fsize))
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_NPROC, 0)
    limit(resource.RLIMIT_CPU, int(cpu), int(cpu) + 1)  # SIGXCPU at the soft limit, SIGKILL at the hard one
    sys.argv = [code_path]
    if guard == "1":
        install_guard(posix.getcwd(), status)
    try:
        # The code's own path as its file name, so that a traceback shows its lines.
        exec(compile(source, code_path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        posix.write(status, b"memory\n")
        raise
    except OSError as e:
        if e.errno == errno.EFBIG:  # Python ignores SIGXFSZ, so RLIMIT_FSIZE shows up as this error
            posix.write(status, b"file size limit\n")
        raise


main(*sys.argv[2:])
''' % {"blocked_exit": BLOCKED_EXIT, "guard_file": _GUARD_FILE}
