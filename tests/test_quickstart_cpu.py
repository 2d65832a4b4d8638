"""The quickstart's CPU block runs as written and trains a step (issue 45).

The block is taken from docs/quickstart.md as tests/test_docs.py takes its snippets, and run
with bash in a scratch directory that holds what the page assumes of a checkout after
``bash .ci/setup.sh``: ``examples/`` and ``.venv-vllm`` (links), with ``.venv`` active (its
``bin`` first on PATH). The only change to the text: its two ports (Redis 6379, vLLM 8000)
become free ones, so the test cannot meet another server on this machine. It starts its own
vLLM server because the page does: ~40-90 s of the test's time on 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollq.ops.local.stack import free_port
from tests.integration.interpreters import vllm_python
from tests.test_docs import blocks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]


def cpu_block() -> str:
    [block] = [b for b in blocks("bash") if b.page.name == "quickstart.md"
               and ".venv-vllm/bin/python -m vllm" in b.text]
    return block.text


def test_the_cpu_block_names_what_a_cpu_run_needs() -> None:
    text = cpu_block()
    for needed in (".venv-vllm/bin/python", "--host 127.0.0.1", "--served-model-name",
                   "--device cpu", "examples/rewards/digits.yaml", "rollq tiny-model",
                   "--kv-cache-memory-bytes", "--batch-groups 4"):
        assert needed in text, needed
    assert "source=" not in text and "reward.yaml " not in text  # no file the page lacks


def test_the_quickstarts_cpu_block_runs_as_written_and_trains_a_step(tmp_path: Path) -> None:
    python = Path(vllm_python())
    (tmp_path / ".venv-vllm").symlink_to(python.parent.parent)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    redis_port, vllm_port = free_port(), free_port()
    script = (cpu_block().replace("6379", str(redis_port))
              .replace("127.0.0.1:8000", f"127.0.0.1:{vllm_port}")
              .replace("--port 8000", f"--port {vllm_port}"))
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                   "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
    log = tmp_path / "block.log"
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=out,
                                   stderr=subprocess.STDOUT, env=environment,
                                   start_new_session=True)
    try:
        while "step 1 reward" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() - started < 360, log.read_text(errors="replace")[-4000:]
            time.sleep(1.0)
    finally:  # the block's background processes are its session's: stop them all
        with_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with_group(process, signal.SIGKILL)
        process.wait()
    print(f"the CPU block trained a step {time.monotonic() - started:.0f} s after its start")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text.split("step 1 reward")[0], text[-4000:]


def with_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
