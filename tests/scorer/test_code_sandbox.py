"""The `code` reward's sandbox: what a candidate's program cannot do.

Infinite loops, sleeps, CPU burners, memory and output bombs are killed at their limits;
writes outside its working directory, a secret outside and the network (loopback included)
are out of reach; the environment is scrubbed; each run holds its own uid, and whatever a
run leaves behind is killed with it. After every test no process of the sandbox uid is left
and this process has no child. The fork bomb runs last and only after a harmless probe
showed the process limit holds.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollq.consumers.scorer.sandbox import Sandbox, SandboxLimits, sandbox_processes
from tests.scorer.code_helpers import (
    SPARE_UID,
    UID,
    run,
    score,
    unharmed,  # noqa: F401  # autouse: every test checked
)

if os.geteuid() != 0 or not hasattr(os, "pidfd_open"):
    pytest.skip("the code sandbox needs root on Linux", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


# -- containment ----------------------------------------------------------------------------

def test_an_infinite_loop_and_a_sleep_are_killed_at_the_wall_limit() -> None:
    started = time.monotonic()
    assert score("while True:\n    pass", wall_s=1.0) == 0.0
    slept = run("import time\ntime.sleep(30)", wall_s=1.0)
    assert slept.timed_out and slept.returncode is None  # cut at the wall, not at its end
    # Two runs of a 1 s wall (counted from the candidate's start) and their kills: ~6 s
    # quietly; the bound is far below the 30 s sleep, with room for a loaded machine.
    assert time.monotonic() - started < 25


@pytest.mark.slow  # ~1 s alone; several on a loaded machine
def test_a_cpu_burner_is_killed_by_the_cpu_limit() -> None:
    # A generous wall: on a loaded machine 1 CPU second may take several wall seconds.
    result = run("while True:\n    pass", wall_s=30.0, cpu_s=1)
    assert not result.timed_out
    assert result.returncode == -signal.SIGKILL


def test_a_memory_bomb_fails_its_case() -> None:
    assert score("x = bytearray(10 ** 10)\nprint(3)", [{"input": "", "output": "3"}]) == 0.0
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert result.returncode == 1 and b"MemoryError" in result.stderr


def test_huge_output_is_cut_and_killed() -> None:
    result = run("while True:\n    print('x' * 4096)", output_bytes=64 << 10)
    assert result.output_exceeded and len(result.stdout) == 64 << 10
    assert not result.timed_out  # killed at the cap, not at the wall
    assert score("while True:\n    print('3')", [{"input": "", "output": "3"}]) == 0.0


def test_writes_outside_the_working_directory_fail() -> None:
    target = f"rollq-sandbox-escape-{os.getpid()}"
    program = f"""
import os
for path in ["/tmp/{target}", "/var/tmp/{target}", "/dev/shm/{target}", "{REPO}/{target}",
             "/{target}", "/etc/{target}"]:
    try:
        open(path, "w").write("escaped")
        print("wrote", path)
    except OSError as exc:
        print("denied", type(exc).__name__)
open("inside.txt", "w").write("ok")
print(open("inside.txt").read())
"""
    result = run(program)
    lines = result.stdout.decode().splitlines()
    # Every write is denied; which error depends on where the checkout lies (under /tmp it
    # sits below the sandbox's empty read-only /tmp: no such directory, not no permission).
    assert len(lines) == 7 and all(line.startswith("denied ") for line in lines[:-1]), lines
    assert lines[-1] == "ok"
    for path in [f"/tmp/{target}", f"/var/tmp/{target}", f"/dev/shm/{target}",
                 str(REPO / target), f"/{target}", f"/etc/{target}"]:
        assert not os.path.exists(path)
    big = run("open('big', 'wb').write(b'x' * (2 << 20))", file_bytes=1 << 20)
    assert big.returncode != 0 and b"File too large" in big.stderr


def test_a_secret_outside_cannot_be_read() -> None:
    directory = tempfile.mkdtemp(prefix="rollq-secret-", dir="/var/lib")
    try:
        os.chmod(directory, 0o755)
        secret = Path(directory, "secret")
        secret.write_text("hunter2")
        secret.chmod(stat.S_IRUSR | stat.S_IWUSR)
        result = run(f"print(open({str(secret)!r}).read())")
        assert result.returncode == 1 and b"PermissionError" in result.stderr
        assert b"hunter2" not in result.stdout
        # The run directory of the sandbox itself is out of reach too (its path is hidden).
        assert run("import os\nprint(os.listdir('/tmp'))").stdout == b"[]\n"
    finally:
        shutil.rmtree(directory)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def test_no_network_not_even_loopback(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    program = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""
    assert score(program, [{"input": "", "output": "connected"}]) == 0.0
    assert run(program).stdout.startswith(b"refused")
    with pytest.raises(BlockingIOError):
        listener.accept()


def test_allow_network_gives_the_candidate_the_scorers_network(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n" \
              "print('connected')"
    assert score(program, [{"input": "", "output": "connected"}], allow_network=True) == 1.0


def test_the_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLQ_TEST_SECRET", "hunter2")
    result = run("import os, sys\nprint(sorted(os.environ), os.getuid(), sys.flags.isolated, "
                 "sys.flags.no_site)")
    assert result.stdout == f"['LANG', 'PATH'] {UID} 1 1\n".encode()


def test_each_run_holds_its_own_uid() -> None:
    lock = os.open(os.path.join(tempfile.gettempdir(), f".rollq-sandbox-uid-{UID}.lock"),
                   os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a concurrent run would
        sandbox = Sandbox(limits=SandboxLimits(wall_s=2.0), uids=(UID, SPARE_UID))
        assert sandbox.run({"main.py": "import os\nprint(os.getuid())"}).stdout == \
            f"{SPARE_UID}\n".encode()
    finally:
        os.close(lock)


def test_processes_left_behind_are_killed_with_the_run() -> None:
    program = ("import os, subprocess, time\n"
               "subprocess.Popen(['/bin/sleep', '60'])\n"
               "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
               "print('bye')")
    assert run(program).stdout == b"bye\n"
    assert sandbox_processes(UID) == []  # checked again, with a deadline, by `unharmed`


# -- last: the fork bomb, only once the process limit is proven -------------------------------

PROBE = """
import subprocess
started = []
for _ in range(50):
    try:
        started.append(subprocess.Popen(["/bin/sleep", "1"]))
    except OSError:
        pass
print(len(started))
"""

BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_zz_a_fork_bomb_is_contained() -> None:
    probe = run(PROBE, processes=16)
    if probe.returncode != 0 or probe.stdout != b"15\n":  # 16 with the candidate
        pytest.fail(f"the process limit does not hold ({probe}): not running the fork bomb")
    started = time.monotonic()
    result = run(BOMB, processes=16, wall_s=1.0)
    # cut at the 1 s wall, the whole bomb reaped: ~3 s quietly, room for a loaded machine
    assert result.timed_out and time.monotonic() - started < 30
    assert score(BOMB + "\nprint(3)", [{"input": "", "output": "3"}], wall_s=1.0) == 0.0
