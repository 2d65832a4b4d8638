"""rollq installs as one package, with a slim core (issue: "Installs as one package").

A fresh venv gets ``pip install <checkout>`` (the core, no extras) from a copy of the
checkout's files: then ``from rollq import SyncTrainerClient`` works with no fastapi,
uvicorn, sympy (math-verify) or arq installed; site-packages gains ``rollq`` and no
``schemas``, ``producers``, ``consumers`` or ``ops``; a project with its own ``schemas.py``
and ``ops/`` keeps them and imports rollq beside them; and a role that needs an extra says
which one. Needs the package index (or pip's cache) for the core's dependencies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _copy_checkout(into: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore), links kept: what a
    user's clone holds, without this checkout's build leftovers or environments."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, target = ROOT / name, into / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree, not yet in git
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    return into


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("install")
    checkout = _copy_checkout(base / "checkout")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", str(checkout)],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def _python(venv: Path, code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_sdk_imports_from_the_core_alone(core_venv: Path) -> None:
    done = _python(core_venv, """
        import importlib.util, sys
        from rollq import SyncTrainerClient, TrainerClient, Env, RewardComponent
        absent = [m for m in ("fastapi", "uvicorn", "sympy", "math_verify", "arq", "torch")
                  if importlib.util.find_spec(m) is not None]
        print("absent-but-found:", absent)
        assert not absent, absent
        print(SyncTrainerClient.__module__)
        """)
    assert done.returncode == 0, done.stderr
    assert "rollq.consumers.trainer.sync" in done.stdout


def test_site_packages_gains_no_generic_top_level_name(core_venv: Path) -> None:
    [site] = list((core_venv / "lib").glob("python*/site-packages"))
    names = {p.name for p in site.iterdir()}
    assert "rollq" in names
    assert not names & {"schemas", "producers", "consumers", "ops"}
    installed = site / "rollq"
    for folder in ("schemas", "producers", "consumers", "ops"):
        assert (installed / folder / "__init__.py").is_file()  # real files, not links
        assert not (installed / folder).is_symlink()
    assert (installed / "producers" / "data" / "sums.jsonl").is_file()  # package data


def test_a_project_with_its_own_schemas_and_ops_still_imports_rollq(core_venv: Path,
                                                                    tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "ops").mkdir(parents=True)
    (project / "schemas.py").write_text("MINE = 'schemas of the project'\n")
    (project / "ops" / "__init__.py").write_text("MINE = 'ops of the project'\n")
    done = _python(core_venv, """
        import schemas, ops
        from rollq import SyncTrainerClient, ScoredGroup
        import rollq.schemas
        assert schemas.MINE == "schemas of the project", schemas.__file__
        assert ops.MINE == "ops of the project", ops.__file__
        assert rollq.schemas.ScoredGroup is ScoredGroup
        print("ok")
        """, cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_role_without_its_extra_names_the_extra(core_venv: Path) -> None:
    rollq = core_venv / "bin" / "rollq"
    shown = subprocess.run([str(rollq), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "workers" in shown.stdout
    done = subprocess.run([str(rollq), "workers", "--redis-url", "redis://127.0.0.1:9/0",
                           "--log-format", "console"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert "pip install 'rollq[roles]'" in done.stderr
