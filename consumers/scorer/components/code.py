"""Code execution (AReaL's `areal-code`): run the completion's Python against test cases.

Each test case runs in its own `Sandbox` (consumers.scorer.sandbox): a fresh process in
new namespaces, as an unprivileged uid, with wall, CPU, memory, process, file-size and
output limits, no network and a throwaway working directory. Whatever the candidate does
is a verdict on that case (it passes or it does not); only a failure of the sandbox
itself raises (`ScoringError("sandbox_error")`: the reward is unknown, never 0).

Test cases come from the group's metadata (`tests_field`), in one of these shapes:

- a list of cases, each either
  - stdin/stdout: ``{"input": "1 2\\n", "output": "3\\n"}`` — the program reads `input`
    on stdin; it passes when it exits with 0 and its stdout equals `output` under
    `compare`;
  - assert: ``{"assert": "assert add(1, 2) == 3"}`` — the candidate is executed as a
    module named ``solution`` (so its ``if __name__ == "__main__"`` block does not run),
    then the assert code in the same namespace; it passes when both complete, stdin
    empty. A candidate that exits early (``sys.exit``/``os._exit``) fails: a marker
    printed after the asserts must arrive. The marker is random per run, but the
    candidate's process could read it: the sandbox bounds what hostile code can reach,
    not how it may fool a check inside its own process.
- the APPS/TACO stdin shape ``{"inputs": [...], "outputs": [...]}``;
- either of the above as a JSON string.

Call-based APPS cases (``fn_name``) are not supported: write them as asserts.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from rollq.consumers.scorer.components.base import ComponentSettings, Placement, RewardComponent
from rollq.consumers.scorer.errors import ScoringError
from rollq.consumers.scorer.sample import Sample
from rollq.consumers.scorer.sandbox import Sandbox, SandboxLimits

Extraction = Literal["fenced_or_whole", "fenced", "whole"]
Comparison = Literal["exact", "lines", "tokens"]


class CodeSettings(ComponentSettings):
    """Settings of `code`.

    What is run:

    - `tests_field`: the metadata field (per completion first, then per group) holding the
      test cases (shapes in the module docstring). A group without it is not scored
      (`MissingFieldError`); malformed cases raise `ScoringError("bad_tests")`; an empty
      list gives None (skipped: there is nothing to score against).
    - `region`: `answer` (the text after the reasoning trace; empty when the trace is
      unclosed) or `anywhere` (the whole completion).
    - `extraction`: `fenced_or_whole` (default) takes the last fenced block tagged
      ``python``/``py``/``python3`` (case-insensitive), else the last untagged fenced
      block (a bare opening fence), else the whole region; `fenced` the same blocks but no
      fallback (no block: 0.0); `whole` the whole region. A fence that is never closed
      does not make a block. Blank code scores 0.0 without running anything.
    - `max_tests`: run at most the first N cases (None: all).

    How it is scored:

    - `compare`: stdout against the expected output, both decoded as UTF-8: `exact`
      (identical), `lines` (default: lines compared with trailing whitespace removed,
      blank lines at the start and end ignored) or `tokens` (the whitespace-separated
      tokens are equal).
    - `scoring`: `fraction` (default: passed / run cases, in [0, 1]) or `all` (1.0 when
      every case passes, else 0.0; stops at the first failing case).

    The sandbox (per case; see `consumers.scorer.sandbox`):

    - `wall_s` (seconds, default 5), `cpu_s` (whole CPU seconds per process, default 5),
      `memory_mb` (address space per process, MiB, default 512), `max_processes`
      (processes and threads of the sandbox uid, the candidate included; default 16),
      `max_output_bytes` (stdout + stderr; more kills the case, which fails; default
      1 MiB), `max_file_bytes` (largest file written, default 16 MiB), `workdir_mb` (the
      working directory's tmpfs, MiB, default 64), `max_open_files` (default 64).
    - `interpreter`: the Python that runs candidates (an absolute path, or a name looked
      up in /usr/local/bin:/usr/bin:/bin; default `python3`); the sandbox uid must be able
      to execute it. Candidates get the standard library only (`-I -S`).
    - `sandbox_uids`, `sandbox_gid`: the unprivileged ids candidates run as (default
      nobody, 65534). Each running case holds one uid exclusively; give as many as pool
      workers. They must not be used by anything else.
    - `allow_network`: False (default): a new network namespace per case, so the
      candidate cannot connect anywhere (127.0.0.1 included); when the namespace cannot
      be created the component refuses to start (`RewardConfigError`). True: the candidate has
      the scorer's network — for trusted code only.
    - `hidden_paths`: world-writable directories covered by an empty read-only tmpfs in
      the sandbox (absolute paths).
    - `work_root`: where run directories and uid lock files go (default: the system
      temporary directory).

    The scorer must run as root; the component checks the sandbox when it opens. Set the
    component entry's `timeout_s` above ``cases × (wall_s + 0.5)``: the entry's timeout is
    an infrastructure failure, the sandbox's wall limit is the candidate's.
    """

    tests_field: str = Field(default="tests", min_length=1)
    region: Literal["answer", "anywhere"] = "answer"
    extraction: Extraction = "fenced_or_whole"
    max_tests: int | None = Field(default=None, ge=1)
    compare: Comparison = "lines"
    scoring: Literal["fraction", "all"] = "fraction"
    wall_s: float = Field(default=5.0, gt=0, le=600)
    cpu_s: int = Field(default=5, ge=1, le=3600)
    memory_mb: int = Field(default=512, ge=32, le=1 << 20)
    max_processes: int = Field(default=16, ge=1, le=4096)
    max_output_bytes: int = Field(default=1 << 20, ge=1024)
    max_file_bytes: int = Field(default=16 << 20, ge=0)
    workdir_mb: int = Field(default=64, ge=1, le=1 << 16)
    max_open_files: int = Field(default=64, ge=16, le=1 << 20)
    interpreter: str = Field(default="python3", min_length=1)
    sandbox_uids: tuple[int, ...] = (65534,)
    sandbox_gid: int = Field(default=65534, ge=1, le=(1 << 32) - 2)
    allow_network: bool = False
    hidden_paths: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
    work_root: str | None = None

    @field_validator("sandbox_uids")
    @classmethod
    def _unprivileged(cls, uids: tuple[int, ...]) -> tuple[int, ...]:
        if not uids:
            raise ValueError("at least one uid is needed")
        if any(uid < 1 or uid > (1 << 32) - 2 for uid in uids):
            raise ValueError(f"uids must be in 1..{(1 << 32) - 2} (never root): {list(uids)}")
        if len(set(uids)) != len(uids):
            raise ValueError(f"duplicate uids: {list(uids)}")
        return uids

    @field_validator("hidden_paths")
    @classmethod
    def _absolute(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        relative = [path for path in paths if not path.startswith("/")]
        if relative:
            raise ValueError(f"paths must be absolute: {relative}")
        return paths


@dataclass(frozen=True)
class StdioCase:
    """A program run with `input` on stdin whose stdout must equal `output`."""

    input: str
    output: str


@dataclass(frozen=True)
class AssertCase:
    """Python code run after the candidate, in its namespace, that must complete."""

    code: str


TestCase = StdioCase | AssertCase

_FENCED = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = '''\
def _rollq_harness():
    import os, sys
    namespace = {{"__name__": "solution", "__file__": "solution.py"}}
    with open("solution.py", "rb") as source:
        exec(compile(source.read(), "solution.py", "exec"), namespace)
    with open("test.py", "rb") as source:
        exec(compile(source.read(), "test.py", "exec"), namespace)
    sys.stdout.flush()
    os.write(1, b"\\n{marker}\\n")
_rollq_harness()
'''


def extract_code(text: str, extraction: Extraction) -> str | None:
    """The program in `text` under the `extraction` policy (see `CodeSettings`); None when
    `fenced` finds no block."""
    if extraction == "whole":
        return text
    blocks = _FENCED.findall(text)
    tagged = [code for tag, code in blocks if tag]
    untagged = [code for tag, code in blocks if not tag]
    if tagged or untagged:
        return str((tagged or untagged)[-1])
    return text if extraction == "fenced_or_whole" else None


def parse_tests(raw: Any) -> list[TestCase]:
    """The test cases in `raw` (shapes in the module docstring); raises
    `ScoringError("bad_tests")` naming what is wrong."""
    if isinstance(raw, str | bytes):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ScoringError("bad_tests", f"test cases are not valid JSON: {exc}") from None
    if isinstance(raw, dict) and "fn_name" in raw:
        raise ScoringError("bad_tests", "call-based cases (fn_name) are not supported; "
                          "write them as {'assert': ...} cases")
    if isinstance(raw, dict) and set(raw) == {"inputs", "outputs"}:
        inputs, outputs = raw["inputs"], raw["outputs"]
        if not (isinstance(inputs, list) and isinstance(outputs, list)
                and len(inputs) == len(outputs)):
            raise ScoringError("bad_tests", "'inputs' and 'outputs' must be lists of one length")
        raw = [{"input": given, "output": expected}
               for given, expected in zip(inputs, outputs, strict=True)]
    if not isinstance(raw, list):
        raise ScoringError("bad_tests", f"test cases must be a list, not {type(raw).__name__}")
    return [_parse_case(index, case) for index, case in enumerate(raw)]


def _parse_case(index: int, case: Any) -> TestCase:
    if isinstance(case, dict) and set(case) == {"assert"} and isinstance(case["assert"], str):
        return AssertCase(case["assert"])
    if (isinstance(case, dict) and set(case) == {"input", "output"}
            and all(isinstance(value, str) for value in case.values())):
        return StdioCase(case["input"], case["output"])
    raise ScoringError("bad_tests", f"test case {index} is neither {{'input': str, 'output': "
                      f"str}} nor {{'assert': str}}: {str(case)[:200]}")


def same_output(actual: str, expected: str, compare: Comparison) -> bool:
    """Whether `actual` stdout matches `expected` under `compare` (see `CodeSettings`)."""
    if compare == "exact":
        return actual == expected
    if compare == "tokens":
        return actual.split() == expected.split()
    return _lines(actual) == _lines(expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


class CodeExecution(RewardComponent[CodeSettings]):
    """The fraction of test cases the completion's program passes, or 1/0 for all of
    them (see `CodeSettings`); runs in the process pool, one sandboxed process per case."""

    settings_model = CodeSettings

    def __init__(self, settings: CodeSettings) -> None:
        super().__init__(settings)
        limits = SandboxLimits(
            wall_s=settings.wall_s, cpu_s=settings.cpu_s, memory_bytes=settings.memory_mb << 20,
            processes=settings.max_processes, output_bytes=settings.max_output_bytes,
            file_bytes=settings.max_file_bytes, workdir_bytes=settings.workdir_mb << 20,
            open_files=settings.max_open_files)
        self.sandbox = Sandbox(
            limits=limits, interpreter=settings.interpreter, uids=settings.sandbox_uids,
            gid=settings.sandbox_gid, allow_network=settings.allow_network,
            hidden_paths=settings.hidden_paths, work_root=settings.work_root)

    @property
    def placement(self) -> Placement:
        return "process"

    def required_fields(self) -> tuple[str, ...]:
        return (self.settings.tests_field,)

    async def open(self, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Refuse to start (`RewardConfigError`) when the sandbox cannot run here."""
        self.sandbox.check()

    def score(self, sample: Sample, group: Sequence[Sample]) -> float | None:
        settings = self.settings
        cases = parse_tests(sample.lookup(settings.tests_field))[:settings.max_tests]
        if not cases:
            return None
        code = extract_code(sample.region_text(settings.region), settings.extraction)
        if code is None or not code.strip():
            return 0.0
        passed = 0
        for case in cases:
            if self.passes(code, case):
                passed += 1
            elif settings.scoring == "all":
                return 0.0
        return passed / len(cases)

    def passes(self, code: str, case: TestCase) -> bool:
        """Whether `code` passes `case` (raises `ScoringError` only when the sandbox fails)."""
        if isinstance(case, StdioCase):
            result = self.sandbox.run({"main.py": code}, stdin=case.input)
            return result.succeeded and same_output(
                result.stdout.decode("utf-8", "replace"), case.output, self.settings.compare)
        marker = secrets.token_hex(16)
        result = self.sandbox.run({"main.py": _HARNESS.format(marker=marker),
                                   "solution.py": code, "test.py": case.code})
        return result.succeeded and result.stdout.endswith(f"\n{marker}\n".encode())
