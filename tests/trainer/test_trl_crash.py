"""Exactly once across a crash, under TRL: kill -9 the AsyncGRPOTrainer process mid-run,
restart it from its last checkpoint (``trainer.train(resume_from_checkpoint=...)``), and
every sequence of every group is trained into the final model at most once, every group
trained whole is acked once, and nothing is lost (the accounting of
tests/trainer/test_resume.py, with TRL's own checkpoints and callbacks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.factories import make_group, score
from tests.redis_server import RedisServer
from tests.trainer.helpers import counter
from tests.trainer.test_trl import VOCAB, publish, read

pytest.importorskip("trl", reason="needs the trl extra")

ROOT = Path(__file__).resolve().parents[2]
GROUPS, SIZE, STEPS, PER_STEP = 12, 6, 16, 4  # a group every 1.5 steps: steps split groups


def trainer(url: str, model: Path, out: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    with open(str(log) + ".err", "w") as errors:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.trl_crash_trainer", url, str(model),
             str(out), "--log", str(log), "--steps", str(STEPS), "--save-steps", "5", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors)


def steps(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_mid_run_then_resume_trains_every_group_exactly_once(
        redis_server: RedisServer, tiny_model: Path, tmp_path: Path) -> None:
    url = redis_server.url
    read(url, lambda r: r.flushall())
    ids = [f"g{i:02d}" for i in range(GROUPS)]
    publish(url, [score(make_group(group_id=g, seed=i, vocab=VOCAB, group_size=SIZE))
                  for i, g in enumerate(ids)])
    out, first, second = tmp_path / "out", tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    run = trainer(url, tiny_model, out, first)
    deadline = time.monotonic() + 150
    while not any(int(s["step"]) >= 7 for s in steps(first)):  # type: ignore[call-overload]
        assert run.poll() is None, (tmp_path / "first.jsonl.err").read_text()[-3000:]
        assert time.monotonic() < deadline, "the first run made no progress"
        time.sleep(0.1)
    run.send_signal(signal.SIGKILL)
    run.wait()

    saved = sorted((int(p.name.split("-")[1]), p) for p in out.glob("checkpoint-*")
                   if (p / "rollq_state.json").exists())
    at, checkpoint = saved[-1]
    assert at in (5, 10)
    resumed = trainer(url, tiny_model, out, second, "--resume", str(checkpoint))
    assert resumed.wait(timeout=200) == 0, (tmp_path / "second.jsonl.err").read_text()[-3000:]

    model: Counter[str] = Counter()  # what the final weights were trained on
    for step in steps(first):
        if int(step["step"]) <= at:  # type: ignore[call-overload]
            model.update(step["trained"])  # type: ignore[arg-type]
    for step in steps(second):
        model.update(step["trained"])  # type: ignore[arg-type]
    assert max(model.values()) <= SIZE, f"a sequence trained twice: {model}"
    assert sum(model.values()) == STEPS * PER_STEP, "a step lost its samples"
    whole = sorted(g for g, n in model.items() if n == SIZE)
    assert whole == ids[:len(whole)] and len(whole) >= 9  # in order, none skipped
    assert read(url, lambda r: counter(r, "consumed")) == len(whole)
