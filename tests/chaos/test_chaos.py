"""The CI-sized chaos run (bench/chaos.py at 300 groups): real processes for every role,
random SIGKILLs of workers, scorers and the trainer, one Redis restart (AOF, everysec,
graceful SHUTDOWN). Every admitted group is trained exactly once or dead-lettered with a
reason, and no role needs a restart by hand."""

from __future__ import annotations

import pytest

from bench import chaos


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chaos_loses_and_duplicates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code = chaos.main(["--groups", "400", "--kill-every", "3", "6",
                       "--redis-restart-after-s", "8", "--step-s", "0.15",
                       "--timeout-s", "300"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("chaos: admitted"))
    print(out)
    assert code == 0, out
    assert "lost 0, duplicated 0" in line
    assert "roles that exited by themselves: none" in out
    assert "SIGKILL" in out and "restarting redis-server" in out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chaos_with_trainer_ranks_loses_and_duplicates_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The trainer as 2 torchrun ranks (rank 0 the only consumer); single ranks are among
    the victims: torchrun restarts both from the last checkpoint."""
    pytest.importorskip("torch", reason="needs the train extra")
    code = chaos.main(["--groups", "600", "--kill-every", "3", "6", "--trainer-ranks", "2",
                       "--redis-restart-after-s", "10", "--step-s", "0.15",
                       "--timeout-s", "300", "--seed", "1"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("chaos: admitted"))
    print(out)
    assert code == 0, out
    assert "lost 0, duplicated 0" in line
    assert "roles that exited by themselves: none" in out
    assert "SIGKILL trainer-rank-" in out and "restarting redis-server" in out
