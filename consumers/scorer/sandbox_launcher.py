"""The child side of the code sandbox: enter namespaces, limit, drop privileges, exec.

Run by `consumers.scorer.sandbox` as root, in the (empty) directory that becomes the
candidate's working directory, with ``python -I -S sandbox_launcher.py CONFIG`` (CONFIG:
a `marshal`-ed dict, quicker to load than JSON), so it imports the standard library only.
In order:

1. Ask to be SIGKILLed when the scorer process that started it dies.
2. Unshare a mount, a PID and an IPC namespace (required), then a network namespace
   (unless `network` is true): the new one has only a loopback device, down, so every
   connect fails, 127.0.0.1 included.
3. Make every mount private; mount a size-limited tmpfs owned by the sandbox uid on the
   working directory, enter it and write the candidate's `files` there (so nothing the
   candidate writes reaches the scorer's disk); then cover each `hidden` directory (the
   world-writable ones: /tmp, /var/tmp, /dev/shm, …) with an empty read-only tmpfs. The
   working directory stays reachable by relative paths.
4. Fork the candidate, which becomes PID 1 of the new PID namespace: when it exits or is
   killed, the kernel kills every process it left behind. The launcher waits for it and
   writes ``exit <wait status>`` on the status pipe. SIGTERM makes the launcher SIGKILL
   the candidate (and so the whole namespace) and reap it: the scorer's wall-clock kill.
5. In the candidate, before exec: a fresh /proc, the rlimits (CPU, address space,
   processes, file size, open files, no core dumps), no supplementary groups, the
   sandbox gid and uid (all three ids, checked), parent-death signal, no-new-privs, then
   ``ready`` on the status pipe (closed on exec) and `execve` with a scrubbed environment.

Any failure before exec is written as ``error <text>`` on the status pipe: the scorer
reports it as a failure of the sandbox, never as the candidate's verdict.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, kind: str | None, flags: int, data: str | None) -> None:
    _check(_libc.mount(source.encode(), target.encode(),
                       kind.encode() if kind else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {kind or source} on {target}")


def _prctl(option: int, value: int, what: str) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), what)


def _report(status_fd: int, line: str) -> None:
    os.write(status_fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))


def _isolate(config: dict[str, Any]) -> None:
    """Steps 1–3, in the launcher (root)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != config["parent_pid"]:
        raise OSError("the scorer process exited before the sandbox started")
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC),
           "unshare(mount, pid, ipc namespaces)")
    if not config["network"]:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(network namespace)")
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    workdir = os.getcwd()
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['workdir_bytes']},mode=700,uid={config['uid']},gid={config['gid']}")
    os.chdir(workdir)  # into the new mount
    for name, text in config["files"].items():
        with open(name, "x", encoding="utf-8") as file:
            file.write(text)
    for path in config["hidden"]:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "size=4k,mode=755")


def _become_candidate(config: dict[str, Any]) -> None:
    """Step 5, in the forked child (PID 1 of the new namespace); execs or raises."""
    status_fd = config["status_fd"]
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    limits = config["limits"]
    # Soft = hard: SIGKILL at the limit. A SIGXCPU first would be lost on the candidate,
    # PID 1 of its namespace, which the kernel spares signals it has no handler for.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"],) * 2)
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    uid, gid = config["uid"], config["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or uid == 0:
        raise OSError(f"privileges not dropped to uid {uid}, gid {gid}")
    # Cleared by the uid change above, so set here: the launcher's death kills the sandbox.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
    os.set_inheritable(status_fd, False)
    _report(status_fd, "ready")
    os.execve(config["argv"][0], config["argv"], config["env"])


_child = 0


def _stop(signum: int, frame: object) -> None:
    if _child == 0:  # not forked yet: nothing to reap
        os._exit(1)
    os.kill(_child, signal.SIGKILL)


def main(argv: list[str]) -> None:
    global _child
    with open(argv[1], "rb") as file:
        config = marshal.load(file)
    status_fd = config["status_fd"]
    signal.signal(signal.SIGTERM, _stop)
    try:
        _isolate(config)
        _child = os.fork()
    except BaseException as exc:
        _report(status_fd, f"error {type(exc).__name__}: {exc}")
        os._exit(1)
    if _child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            _become_candidate(config)
        except BaseException as exc:
            _report(status_fd, f"error {type(exc).__name__}: {exc}")
        os._exit(127)
    # The launcher must never write into the candidate's output.
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in (0, 1, 2):
        os.dup2(null, descriptor)
    _, wait_status = os.waitpid(_child, 0)
    _report(status_fd, f"exit {wait_status}")
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
