"""Run untrusted Python in a throwaway sandbox and report what it did (the scorer's side).

`Sandbox.run(files, stdin=…)` writes the files to a fresh directory, starts
`sandbox_launcher.py` (as root; see its docstring for the isolation: mount, PID, IPC and
network namespaces, a private size-limited tmpfs as the working directory, the
world-writable directories hidden, rlimits, a dedicated unprivileged uid, no-new-privs)
and watches it from this process: a wall-clock deadline, an output cap (stdout + stderr,
read as they come; past the cap the run is killed) and, afterwards, a check that no
process of the sandbox uid is left in any sandbox namespace.

What the candidate does — exit codes, exceptions, signals, timeouts, floods of output —
is a `SandboxResult`, never an exception. A failure of the sandbox itself (the directory
cannot be made, the interpreter cannot be started, a namespace cannot be created, a
process survives SIGKILL) raises `ScoringError("sandbox_error", …)`: the reward is unknown,
the bridge retries and then dead-letters (`reward_error`), never a score of 0.

Uids: each run holds one of `uids` exclusively (a `flock` on a lock file in the work
root), because RLIMIT_NPROC counts every process of a uid machine-wide: two runs sharing
a uid would share one process budget. Give as many uids as the pool has workers; they must
not be used by anything else (a service running as `nobody` eats into the budget).

Not covered: world-readable files stay readable (only what file permissions deny the
uid is out of reach); memory is limited per process, so all the processes of a run may
use `processes × memory_bytes` together; there is no seccomp filter. A pool worker killed
mid-run leaves its sandbox to the parent-death signals, and the orphans to the
container's init: run the scorer under one that reaps (e.g. `docker run --init`).
"""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rollq.consumers.scorer.errors import RewardConfigError, ScoringError

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
"""PATH of the candidate's environment, and where a bare `interpreter` name is looked up."""

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_BOOTSTRAP = "exec(compile(open('main.py','rb').read(),'main.py','exec'))"
# -c rather than a script path: Python would make the path absolute, and the directory's
# absolute path is hidden inside the sandbox.
_STOP_GRACE_S = 2.0
START_S = 10.0
"""Seconds the launcher may take to set the sandbox up and report ``ready``."""
_REAP_DEADLINE_S = 5.0
_STDERR_KEPT = 4096


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    - `wall_s`: wall-clock seconds from the candidate's start (the launcher's ``ready``)
      until the run is killed. The launcher's set-up (~20–50 ms on a quiet machine, over a
      second on a loaded one) is not the candidate's time: it has its own ceiling,
      ``START_S``, past which the run is a ``sandbox_error`` (an infrastructure failure).
    - `cpu_s`: CPU seconds per process (RLIMIT_CPU, soft = hard: SIGKILL at the limit).
    - `memory_bytes`: address space per process (RLIMIT_AS).
    - `processes`: processes and threads of the sandbox uid, the candidate included
      (RLIMIT_NPROC).
    - `output_bytes`: stdout + stderr together; one byte more and the run is killed.
    - `file_bytes`: the largest file the candidate may write (RLIMIT_FSIZE).
    - `workdir_bytes`: the size of the working directory's tmpfs (all files together).
    - `open_files`: file descriptors per process (RLIMIT_NOFILE).
    """

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20
    processes: int = 16
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    workdir_bytes: int = 64 << 20
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """What the candidate did.

    - `returncode`: its exit code, or −N when a signal N ended it (−9, SIGKILL, for the
      CPU limit); None when the sandbox killed it (`timed_out`, `output_exceeded`).
    - `stdout`: at most `output_bytes` bytes; `stderr`: its first 4 KiB (diagnostics).
    - `timed_out`: it ran past `wall_s`; `output_exceeded`: it wrote past `output_bytes`.
    - `seconds`: wall seconds the run took.
    """

    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_exceeded: bool
    seconds: float

    @property
    def succeeded(self) -> bool:
        """True when it exited with 0 within every limit."""
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


@dataclass(frozen=True)
class Sandbox:
    """A sandbox configuration (picklable: it travels to pool workers with its component).

    - `interpreter`: a Python executable, as an absolute path or a name looked up in
      `SANDBOX_PATH`; it runs both the launcher (as root) and the candidate (as the
      sandbox uid, so that uid must be able to execute it), with `-I -S -B -X utf8`:
      isolated mode, no site-packages, only the standard library.
    - `uids`, `gid`: the unprivileged ids candidates run as (see the module docstring).
    - `allow_network`: False (default) gives every run a new network namespace, so every
      connect fails; True leaves the scorer's network to the candidate (trusted code only).
    - `hidden_paths`: directories replaced by an empty read-only tmpfs inside the sandbox.
    - `work_root`: where the run directories and uid lock files go (default: the system
      temporary directory).
    """

    limits: SandboxLimits = SandboxLimits()
    interpreter: str = "python3"
    uids: tuple[int, ...] = (65534,)
    gid: int = 65534
    allow_network: bool = False
    hidden_paths: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
    work_root: str | None = None

    def check(self) -> None:
        """Run a trivial program once; raise `RewardConfigError` saying why when it cannot run.

        Called when a component opens, so a scorer that cannot sandbox refuses to start.
        """
        if os.geteuid() != 0:
            raise RewardConfigError(
                "code sandbox: the scorer must run as root (it creates namespaces and drops "
                f"privileges to uid {self.uids[0]}); it runs as uid {os.geteuid()}")
        try:
            result = self.run({"main.py": "print('sandbox ok')\n"})
        except ScoringError as exc:
            hint = ""
            if "network namespace" in str(exc):
                hint = ("; set allow_network: true to run candidates with the scorer's "
                        "network (trusted code only)")
            raise RewardConfigError(f"code sandbox cannot run: {exc}{hint}") from None
        if result.stdout != b"sandbox ok\n":
            raise RewardConfigError(
                f"code sandbox: {self.interpreter!r} did not run a trivial program as uid "
                f"{self.uids[0]} (exit {result.returncode}): "
                f"{result.stderr.decode('utf-8', 'replace')[-500:]}")

    def run(self, files: Mapping[str, str], *, stdin: str | None = None) -> SandboxResult:
        """Run `files["main.py"]` with `files` in its working directory and `stdin` (None:
        an empty stdin); raise `ScoringError("sandbox_error")` when the sandbox fails."""
        interpreter = self._resolve_interpreter()
        root = self.work_root or tempfile.gettempdir()
        try:
            with _claimed_uid(self.uids, root) as uid:
                # Left over from a worker killed mid-run: nobody else runs as `uid` now.
                _reap(uid)
                for stale in Path(root).glob(f"rollq-code-{uid}-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                try:
                    with _run_directory(root, uid) as directory:
                        return self._run_in(directory, interpreter, uid, files, stdin)
                finally:
                    _reap(uid)
        except OSError as exc:  # reading pipes, /proc, locks: the sandbox's own plumbing
            raise ScoringError("sandbox_error", f"the sandbox failed: {exc!r}") from exc

    def _resolve_interpreter(self) -> str:
        found = shutil.which(self.interpreter, path=SANDBOX_PATH)
        if found is None or not os.path.isabs(found):
            raise ScoringError("sandbox_error",
                              f"interpreter {self.interpreter!r} not found (PATH {SANDBOX_PATH})")
        return found

    def _run_in(self, directory: Path, interpreter: str, uid: int,
                files: Mapping[str, str], stdin: str | None) -> SandboxResult:
        limits = self.limits
        status_read, status_write = os.pipe()
        config = {
            "status_fd": status_write, "parent_pid": os.getpid(), "uid": uid,
            "gid": self.gid, "network": self.allow_network, "hidden": list(self.hidden_paths),
            "workdir_bytes": limits.workdir_bytes, "files": dict(files),
            "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                       "processes": limits.processes, "file_bytes": limits.file_bytes,
                       "open_files": limits.open_files},
            "argv": [interpreter, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP],
            "env": {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
        }
        try:
            # marshal format 4: what every Python 3.4+ reads, for these plain types.
            (directory / "config").write_bytes(marshal.dumps(config, 4))
            stdin_path = directory / "stdin"
            stdin_path.write_text(stdin or "", encoding="utf-8")
            (directory / "work").mkdir(mode=0o700)
            with stdin_path.open("rb") as stdin_file:
                started = time.monotonic()
                process = subprocess.Popen(
                    [interpreter, "-I", "-S", "-B", str(_LAUNCHER),
                     str(directory / "config")],
                    cwd=directory / "work", env={"PATH": SANDBOX_PATH}, stdin=stdin_file,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_write,),
                    start_new_session=True)
        except OSError as exc:
            os.close(status_read)
            raise ScoringError("sandbox_error", f"cannot start the sandbox: {exc}") from exc
        finally:
            os.close(status_write)
        finished = False
        try:
            watched = _watch(process, status_read, limits.output_bytes,
                             started + START_S, limits.wall_s)
            if not watched.killed:
                process.wait(_STOP_GRACE_S)  # it exits right after writing the status
                finished = True
        except subprocess.TimeoutExpired:
            raise ScoringError("sandbox_error", "the launcher did not exit") from None
        finally:
            if not finished:
                _stop(process)
            os.close(status_read)
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
        return _verdict(watched, time.monotonic() - started)


@dataclass
class _Watched:
    stdout: bytearray
    stderr: bytearray
    status: bytearray
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def killed(self) -> bool:
        return self.timed_out or self.output_exceeded


def _watch(process: subprocess.Popen[bytes], status_fd: int, cap: int,
           start_deadline: float, wall_s: float) -> _Watched:
    """Read stdout, stderr and the status pipe until all close, the deadline passes or the
    output passes `cap` bytes. The deadline is `start_deadline` until the launcher reports
    ``ready``, then `wall_s` from that moment."""
    assert process.stdout is not None and process.stderr is not None
    watched = _Watched(bytearray(), bytearray(), bytearray())
    buffers = {process.stdout.fileno(): watched.stdout, process.stderr.fileno(): watched.stderr}
    buffers[status_fd] = watched.status
    total = 0
    deadline, ready = start_deadline, False
    with selectors.DefaultSelector() as selector:
        for descriptor in buffers:
            selector.register(descriptor, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                watched.timed_out = True
                return watched
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                if key.fd != status_fd:
                    total += len(data)
                    if total > cap:
                        buffer += data[:len(data) - (total - cap)]
                        watched.output_exceeded = True
                        return watched
                buffer += data
                if not ready and b"ready\n" in watched.status:
                    deadline, ready = time.monotonic() + wall_s, True
    return watched


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it SIGKILLs and reaps the candidate, which takes the whole
    PID namespace with it); SIGKILL it if it does not exit within the grace."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()  # the candidate's parent-death signal then kills it
        process.wait()


def _verdict(watched: _Watched, seconds: float) -> SandboxResult:
    lines = watched.status.decode("utf-8", "replace").splitlines()
    errors = [line.removeprefix("error ") for line in lines if line.startswith("error ")]
    if errors:
        raise ScoringError("sandbox_error", f"the sandbox failed: {errors[0]}")
    if "ready" not in lines:
        what = f"did not start within {START_S} s" if watched.timed_out else "died while starting"
        raise ScoringError("sandbox_error", f"the sandbox {what}")
    stderr = bytes(watched.stderr[:_STDERR_KEPT])
    if watched.killed:
        return SandboxResult(None, bytes(watched.stdout), stderr, watched.timed_out,
                             watched.output_exceeded, seconds)
    exits = [line.removeprefix("exit ") for line in lines if line.startswith("exit ")]
    if not exits:
        raise ScoringError("sandbox_error", "the launcher exited without the candidate's status")
    returncode = os.waitstatus_to_exitcode(int(exits[0]))
    return SandboxResult(returncode, bytes(watched.stdout), stderr, False, False, seconds)


@contextlib.contextmanager
def _run_directory(root: str, uid: int) -> Iterator[Path]:
    """A fresh root-only directory under `root`, removed afterwards (or, if this process
    dies first, by the next run that holds `uid`)."""
    try:
        directory = Path(tempfile.mkdtemp(prefix=f"rollq-code-{uid}-", dir=root))
    except OSError as exc:
        raise ScoringError("sandbox_error", f"cannot create a run directory in {root!r}: "
                          f"{exc}") from exc
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _claimed_uid(uids: tuple[int, ...], root: str) -> Iterator[int]:
    """Hold one of `uids` exclusively for the block (waiting when all are taken)."""
    descriptors: list[int] = []
    try:
        for uid in uids:
            descriptor = _lock_file(root, uid)
            descriptors.append(descriptor)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield uid
            return
        choice = os.getpid() % len(uids)  # spread the waiters over the uids
        fcntl.flock(descriptors[choice], fcntl.LOCK_EX)
        yield uids[choice]
    finally:
        for descriptor in descriptors:
            os.close(descriptor)  # also releases the lock


def _lock_file(root: str, uid: int) -> int:
    path = os.path.join(root, f".rollq-sandbox-uid-{uid}.lock")
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ScoringError("sandbox_error", f"cannot open the uid lock {path!r}: {exc}") from exc


def sandbox_processes(uid: int) -> list[int]:
    """Pids of the live processes of `uid` in another PID namespace than this process:
    a sandbox's (a service running as `uid` on the host is not one)."""
    own = os.readlink("/proc/self/ns/pid")
    return [int(entry.name) for entry in os.scandir("/proc")
            if entry.name.isdigit() and _is_sandboxed(entry.name, uid, own)]


def _is_sandboxed(pid: str, uid: int, own_namespace: str) -> bool:
    try:  # gone meanwhile, or a zombie (its namespace links are gone)
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as file:
            owner = next((int(line.split()[1]) for line in file if line.startswith("Uid:")),
                         None)
        return owner == uid and os.readlink(f"/proc/{pid}/ns/pid") != own_namespace
    except OSError:
        return False


def _reap(uid: int) -> None:
    """SIGKILL every sandbox process of `uid` and wait until none is left."""
    own = os.readlink("/proc/self/ns/pid")
    deadline = time.monotonic() + _REAP_DEADLINE_S
    while pids := sandbox_processes(uid):
        for pid in pids:
            with contextlib.suppress(OSError):
                descriptor = os.pidfd_open(pid)
                try:
                    # Checked again now that the pidfd pins the process: pids are reused.
                    if _is_sandboxed(str(pid), uid, own):
                        signal.pidfd_send_signal(descriptor, signal.SIGKILL)
                finally:
                    os.close(descriptor)
        if time.monotonic() > deadline:
            raise ScoringError("sandbox_error",
                              f"processes {pids} of sandbox uid {uid} survived SIGKILL")
        time.sleep(0.01)
