"""The seccomp filter of the sandbox (data/envs/sandbox.py): a classic BPF program, built here without new
dependencies, that bubblewrap loads (`bwrap --seccomp FD`) just before it starts the interpreter.

`filter_program(machine=None) -> bytes` is the program for this machine (x86_64 or aarch64; another machine is a
`ValueError`). It kills the process on a foreign syscall ABI and answers EPERM to what no environment needs: every
way to start a process (fork, vfork, clone without CLONE_THREAD; clone3 gets ENOSYS, so the C library falls back to
clone for threads), execveat, tracing and reading other processes (ptrace, process_vm_*, kcmp, pidfd_*), signals
by pid (kill, rt_*sigqueueinfo), scheduling and priority changes, sockets other than AF_UNIX (EAFNOSUPPORT),
terminal injection (ioctl TIOCSTI, TIOCLINUX), device nodes (mknod*), memory files outside every disk bound
(memfd_create), mounts and namespaces, and the kernel's administrative calls (modules, bpf, perf, keyrings,
io_uring, clocks, reboot, ...). execve stays allowed: bwrap itself needs it to start the interpreter, and what it
can then start stays under this filter. See docs/environments.md.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
_ALLOW = 0x7FFF0000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (the low word first: little endian)
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24

CLONE_THREAD = 0x00010000
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

_DENIED = (
    "fork", "vfork", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open",
    "pidfd_send_signal", "pidfd_getfd", "kill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "setpriority",
    "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set", "mknod", "mknodat",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
    "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "iopl", "ioperm", "quotactl", "personality", "vhangup", "syslog", "uselib",
    "name_to_handle_at", "open_by_handle_at", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "fanotify_init", "process_madvise", "memfd_secret", "migrate_pages", "move_pages", "mbind", "set_mempolicy",
    "lookup_dcookie", "memfd_create",
)

# Syscall numbers (asm/unistd_64.h; aarch64: asm-generic/unistd.h, which lacks the legacy calls) and the
# AUDIT_ARCH_* value each filter checks first.
_X86_64 = dict(
    arch=0xC000003E, clone=56, clone3=435, socket=41, ioctl=16,
    fork=57, vfork=58, execveat=322, ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312,
    pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, kill=62, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297,
    setpriority=141, sched_setaffinity=203, sched_setscheduler=144, sched_setparam=142, sched_setattr=314,
    ioprio_set=251, mknod=133, mknodat=259, mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272,
    setns=308, move_mount=429, open_tree=428, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
    bpf=321, perf_event_open=298, userfaultfd=323, keyctl=250, add_key=248, request_key=249, init_module=175,
    finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320, reboot=169, swapon=167, swapoff=168,
    acct=163, settimeofday=164, clock_settime=227, clock_adjtime=305, adjtimex=159, sethostname=170,
    setdomainname=171, iopl=172, ioperm=173, quotactl=179, personality=135, vhangup=153, syslog=103, uselib=134,
    name_to_handle_at=303, open_by_handle_at=304, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    fanotify_init=300, process_madvise=440, memfd_secret=447, migrate_pages=256, move_pages=279, mbind=237,
    set_mempolicy=238, lookup_dcookie=212, memfd_create=319,
)
_AARCH64 = dict(
    arch=0xC00000B7, clone=220, clone3=435, socket=198, ioctl=29,
    execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, pidfd_open=434,
    pidfd_send_signal=424, pidfd_getfd=438, kill=129, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, setpriority=140,
    sched_setaffinity=122, sched_setscheduler=119, sched_setparam=118, sched_setattr=274, ioprio_set=30,
    mknodat=33, mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, move_mount=429,
    open_tree=428, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, bpf=280,
    perf_event_open=241, userfaultfd=282, keyctl=219, add_key=217, request_key=218, init_module=105,
    finit_module=273, delete_module=106, kexec_load=104, kexec_file_load=294, reboot=142, swapon=224, swapoff=225,
    acct=89, settimeofday=170, clock_settime=112, clock_adjtime=266, adjtimex=171, sethostname=161,
    setdomainname=162, quotactl=60, personality=92, vhangup=58, syslog=116, name_to_handle_at=264,
    open_by_handle_at=265, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, fanotify_init=262,
    process_madvise=440, memfd_secret=447, migrate_pages=238, move_pages=239, mbind=235, set_mempolicy=237,
    lookup_dcookie=18, memfd_create=279,
)
_TABLES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}


@functools.lru_cache(maxsize=None)
def filter_program(machine: str | None = None) -> bytes:
    """The filter for `machine` (`platform.machine()` when None) as the bytes of a `struct sock_filter` array."""
    machine = platform.machine() if machine is None else machine
    table = _TABLES.get(machine.lower())
    if table is None:
        raise ValueError(f"no seccomp syscall table for machine {machine!r} (known: x86_64, aarch64)")
    code: list[tuple] = []  # (opcode, k, jump-if-true label, jump-if-false label); a label is an index or None

    def emit(op, k, jt=None, jf=None):
        code.append((op, k, jt, jf))

    def errno_ret(err):
        return _ERRNO | err

    emit(_LD_ABS, _ARCH)
    emit(_JEQ, table["arch"], "nr", None)
    emit(_RET, _KILL_PROCESS)
    code.append("nr")
    emit(_LD_ABS, _NR)
    if table is _X86_64:  # the x32 ABI shares x86_64's arch value and sets this bit in the number
        emit(_JGE, 0x40000000, "eperm", None)
    emit(_JEQ, table["clone3"], "enosys", None)
    emit(_JEQ, table["clone"], "clone", None)
    emit(_JEQ, table["socket"], "socket", None)
    emit(_JEQ, table["ioctl"], "ioctl", None)
    for name in _DENIED:
        if name in table:
            emit(_JEQ, table[name], "eperm", None)
    emit(_RET, _ALLOW)
    code.append("clone")  # a thread (CLONE_THREAD) is allowed, any other clone is a new process
    emit(_LD_ABS, _ARG0)
    emit(_JSET, CLONE_THREAD, "allow", "eperm")
    code.append("socket")
    emit(_LD_ABS, _ARG0)
    emit(_JEQ, AF_UNIX, "allow", None)
    emit(_RET, errno_ret(errno.EAFNOSUPPORT))
    code.append("ioctl")
    emit(_LD_ABS, _ARG1)
    emit(_JEQ, TIOCSTI, "eperm", None)
    emit(_JEQ, TIOCLINUX, "eperm", "allow")
    code.append("allow")
    emit(_RET, _ALLOW)
    code.append("eperm")
    emit(_RET, errno_ret(errno.EPERM))
    code.append("enosys")
    emit(_RET, errno_ret(errno.ENOSYS))
    return _assemble(code)


def _assemble(code: list) -> bytes:
    """Resolve the labels (strings in `code`) into forward jump offsets and pack the instructions."""
    labels, position = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = position
        else:
            position += 1
    out, position = [], 0
    for item in code:
        if isinstance(item, str):
            continue
        op, k, jt, jf = item
        offsets = []
        for target in (jt, jf):
            offset = 0 if target is None else labels[target] - position - 1
            assert 0 <= offset <= 255, (target, offset)  # classic BPF jumps forward only, by at most 255
            offsets.append(offset)
        out.append(struct.pack("=HBBI", op, offsets[0], offsets[1], k))
        position += 1
    return b"".join(out)
