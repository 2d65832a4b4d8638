"""The CI-sized soak (bench/soak.py --short: 90 s, a role restarted every 20 s): Redis
memory, key counts, stream lengths and the seen-set stay flat once their windows are full,
and no group is lost or duplicated. Every role's RSS is reported; it is judged by the full
soak (30 minutes, docs/benchmarks.md), not in 90 s where every role is still warming up
after its restart (``bench.soak.SHORT_REPORTED_ONLY``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_soak_stays_flat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = soak.main(["--short", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    verdict = next(line for line in out.splitlines() if line.startswith("soak: "))
    assert "lost 0, duplicated 0" in verdict, verdict
    assert code == 0, verdict
    assert (tmp_path / "soak.csv").exists()
