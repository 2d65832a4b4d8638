"""The `code` reward: a candidate's program against test cases, in a sandbox.

Whatever the candidate does is a score (0, partial or 1), never an error; a failure of
the sandbox itself is `ScoringError("sandbox_error")`; bad settings are `RewardConfigError`.
After every test no process of the sandbox uid is left and this process has no child.
What the sandbox contains: `test_code_sandbox.py`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollq.consumers.scorer import RewardBridge, RewardConfig, ScoringError
from rollq.consumers.scorer.components.code import extract_code, parse_tests, same_output
from rollq.consumers.scorer.errors import MissingFieldError, RewardConfigError
from rollq.schemas.failures import REWARD_ERROR, classify
from tests.scorer.code_helpers import (
    ADD,
    FAST,
    UID,
    _processes_of,
    _run_directories,
    code,
    fenced,
    run,
    score,
    unharmed,  # noqa: F401  # autouse: every test checked
)
from tests.scorer.helpers import make_sample

if os.geteuid() != 0 or not hasattr(os, "pidfd_open"):
    pytest.skip("the code sandbox needs root on Linux", allow_module_level=True)


async def _eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes (a process table offers no
    event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


ADDER = "a, b = map(int, input().split())\nprint(a + b)"


# -- verdicts of ordinary programs ----------------------------------------------------------

def test_a_correct_program_scores_one() -> None:
    assert score(ADDER) == 1.0


def test_a_wrong_program_scores_zero() -> None:
    assert score("a, b = map(int, input().split())\nprint(a - b)") == 0.0


def test_a_partly_correct_program_scores_the_fraction_or_nothing() -> None:
    partial = "a, b = map(int, input().split())\nprint(3)"
    assert score(partial) == 0.5
    assert score(partial, scoring="all") == 0.0
    assert score(ADDER, scoring="all") == 1.0


def test_a_syntax_error_scores_zero() -> None:
    assert score("def broken(:\n    print(1)") == 0.0


def test_a_runtime_exception_scores_zero_even_after_the_right_output() -> None:
    assert score(ADDER + "\nraise ValueError('late')") == 0.0
    result = run("raise ValueError('boom')")
    assert result.returncode == 1 and b"ValueError: boom" in result.stderr


def test_a_non_zero_exit_scores_zero_even_with_the_right_output() -> None:
    assert score(ADDER + "\nimport sys\nsys.exit(3)") == 0.0
    assert run("import sys\nsys.exit(3)").returncode == 3


def test_stdin_is_the_case_input_and_empty_otherwise() -> None:
    assert run("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc").stdout == b"cba\n"
    assert run("import sys\nprint(repr(sys.stdin.read()))").stdout == b"''\n"


def test_unicode_output_is_compared_as_text() -> None:
    tests = [{"input": "", "output": "héllo wörld ✓ 日本\n"}]
    assert score("print('héllo wörld ✓ 日本')", tests) == 1.0
    assert score("print('hello world')", tests) == 0.0


@pytest.mark.parametrize(("compare", "actual", "expected", "same"), [
    ("exact", "3\n", "3\n", True),
    ("exact", "3 \n", "3\n", False),
    ("lines", "\n3   \n4\n\n\n", "3\n4", True),
    ("lines", "3\n\n4\n", "3\n4\n", False),
    ("lines", " 3\n", "3\n", False),
    ("tokens", "3  4\n5", "3 4 5\n", True),
    ("tokens", "34", "3 4", False),
])
def test_output_comparison(compare: Any, actual: str, expected: str, same: bool) -> None:
    assert same_output(actual, expected, compare) is same


# -- extraction ---------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "policy", "expected"), [
    ("```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```", "fenced_or_whole", "print(2)\n"),
    ("```python\nprint(1)\n```\n```\nprint(3)\n```", "fenced_or_whole", "print(1)\n"),
    ("```\nprint(3)\n```", "fenced_or_whole", "print(3)\n"),
    ("```Python3\nprint(4)\n```", "fenced", "print(4)\n"),
    ("print(5)", "fenced_or_whole", "print(5)"),
    ("print(5)", "fenced", None),
    ("```python\nprint(6)\n```\n```python\nprint(7)", "fenced", "print(6)\n"),  # unclosed
    ("```python\nprint(8)\n```", "whole", "```python\nprint(8)\n```"),
])
def test_extraction_policy(text: str, policy: Any, expected: str | None) -> None:
    assert extract_code(text, policy) == expected


def test_no_code_block_and_an_empty_completion_score_zero() -> None:
    component = code(extraction="fenced")
    prose = make_sample("I would add the numbers.", metadata={"tests": ADD})
    assert component.score(prose, []) == 0.0
    assert code().score(make_sample("", metadata={"tests": ADD}), []) == 0.0
    unclosed = make_sample("<think>still thinking " + ADDER, metadata={"tests": ADD})
    assert code().score(unclosed, []) == 0.0  # the answer region is empty


def test_the_code_is_read_from_the_answer_region() -> None:
    text = "<think>```python\nprint(0)\n```</think>" + fenced(ADDER)
    assert code().score(make_sample(text, metadata={"tests": ADD}), []) == 1.0


# -- test-case formats ----------------------------------------------------------------------

def test_assert_cases_run_after_the_candidate_in_its_namespace() -> None:
    program = ("def add(a, b):\n    return a + b\n\n"
               "if __name__ == '__main__':\n    print(add(int(input()), 1))")
    tests = [{"assert": "assert add(1, 2) == 3"}, {"assert": "assert add(-1, 1) == 0"},
             {"assert": "assert add(2, 2) == 5"}]
    assert score(program, tests) == pytest.approx(2 / 3)
    assert score(program, tests, scoring="all") == 0.0


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)"])
def test_an_early_exit_does_not_pass_assert_cases(exit_call: str) -> None:
    program = f"def add(a, b):\n    return a - b\n{exit_call}"
    assert score(program, [{"assert": "assert add(1, 2) == 3"}]) == 0.0


def test_both_formats_mix_and_dataset_shapes_parse() -> None:
    program = "def double(x):\n    return 2 * x\nif __name__ == '__main__':\n    print(double(21))"
    mixed = [{"input": "", "output": "42"}, {"assert": "assert double(4) == 8"}]
    assert score(program, mixed) == 1.0
    assert score(ADDER, '{"inputs": ["1 2\\n", "2 2\\n"], "outputs": ["3\\n", "5\\n"]}') == 0.5
    assert parse_tests([]) == []
    assert score(ADDER, tests=[]) is None  # nothing to score against: skipped


@pytest.mark.parametrize("bad", [
    "not json", {"fn_name": "f", "inputs": [], "outputs": []}, [{"input": "1"}],
    [{"assert": 3}], {"inputs": ["1"], "outputs": []}, 42,
])
def test_malformed_cases_are_a_reward_error(bad: Any) -> None:
    with pytest.raises(ScoringError) as caught:
        parse_tests(bad)
    assert caught.value.reason == "bad_tests"


# -- failures of the sandbox and of the configuration ---------------------------------------

def test_a_sandbox_failure_is_a_reward_error_not_a_score(tmp_path: Path) -> None:
    missing = code(interpreter="/nonexistent/python3")
    with pytest.raises(ScoringError) as caught:
        missing.score(make_sample(fenced(ADDER), metadata={"tests": ADD}), [])
    assert caught.value.reason == "sandbox_error"
    gone = code(work_root=str(tmp_path / "removed"))
    with pytest.raises(ScoringError) as caught:
        gone.score(make_sample(fenced(ADDER), metadata={"tests": ADD}), [])
    assert caught.value.reason == "sandbox_error"
    assert classify(caught.value).reason == REWARD_ERROR


async def test_a_sandbox_that_cannot_start_refuses_to_open(tmp_path: Path) -> None:
    with pytest.raises(RewardConfigError, match="not found"):
        await code(interpreter="/nonexistent/python3").open()
    # No CAP_SYS_ADMIN: no namespace can be created.
    wrapper = tmp_path / "python-without-cap-sys-admin"
    wrapper.write_text("#!/bin/sh\nexec setpriv --bounding-set=-sys_admin "
                       "--inh-caps=-sys_admin /usr/bin/python3 \"$@\"\n")
    wrapper.chmod(0o755)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    with pytest.raises(RewardConfigError, match="namespace"):
        await code(interpreter=str(wrapper)).open()
    await code().open()  # the real thing opens


@pytest.mark.parametrize(("settings", "field"), [
    ({"wall_s": 0}, "wall_s"), ({"cpu_s": 0}, "cpu_s"), ({"memory_mb": 4}, "memory_mb"),
    ({"max_processes": 0}, "max_processes"), ({"max_output_bytes": 10}, "max_output_bytes"),
    ({"sandbox_uids": [0]}, "sandbox_uids"), ({"sandbox_uids": []}, "sandbox_uids"),
    ({"hidden_paths": ["tmp"]}, "hidden_paths"), ({"scoring": "most"}, "scoring"),
    ({"timeout": 3}, "timeout"),
])
def test_bad_settings_are_config_errors(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(RewardConfigError, match=rf"component 'code': settings\.{field}"):
        RewardConfig.from_mapping({"components": [
            {"name": "code", "component": "code", "settings": settings}]})


def test_a_group_without_tests_is_not_scored() -> None:
    assert code().required_fields() == ("tests",)
    assert code(tests_field="cases").required_fields() == ("cases",)
    with pytest.raises(KeyError):
        code().score(make_sample(fenced(ADDER)), [])


# -- through the bridge -------------------------------------------------------------------

@pytest.mark.slow  # a spawned pool worker, and a loaded 2-core machine
async def test_the_bridge_scores_code_in_a_one_process_pool(tmp_path: Path) -> None:
    work_root = tmp_path / "runs"
    work_root.mkdir()
    config = RewardConfig.from_mapping({
        "components": [{"name": "code", "component": "code", "timeout_s": 30, "retries": 0,
                        "settings": {**FAST, "wall_s": 1.0, "work_root": str(work_root)}}],
        "pool": {"workers": 1}, "advantages": {"zero_variance": "keep"}})
    async with RewardBridge(config) as bridge:
        assert bridge._pool is not None
        group = [bridge.make_sample(fenced(program), [1, 2, 3], metadata={"tests": ADD})
                 for program in (ADDER, "print(3)", "while True:\n    pass")]
        result = await bridge.score_group(group)
        assert result.components["code"] == [1.0, 0.5, 0.0]
        assert result.flags == ()
        with pytest.raises(MissingFieldError):
            await bridge.score_group([bridge.make_sample(fenced(ADDER), [1])])
        shutil.rmtree(work_root)  # the sandbox breaks under the running scorer
        with pytest.raises(ScoringError) as caught:
            await bridge.score_group(group[:1])
        assert caught.value.reason == "sandbox_error"
        assert caught.value.component == "code"


@pytest.mark.slow  # a spawned pool worker, and its replacement
async def test_a_pool_worker_killed_mid_run_takes_its_sandbox_along() -> None:
    """The entry's timeout (an infrastructure failure) is shorter than the sandbox's wall:
    the bridge kills the pool worker while its candidate sleeps; the parent-death signals
    kill the launcher and the candidate's whole namespace (checked by `unharmed`)."""
    config = RewardConfig.from_mapping({
        "components": [{"name": "code", "component": "code", "timeout_s": 1.0, "retries": 0,
                        "settings": {**FAST, "wall_s": 30.0}}],
        "pool": {"workers": 1}, "advantages": {"zero_variance": "keep"}})
    async with RewardBridge(config) as bridge:
        sleeper = bridge.make_sample(fenced("import time\ntime.sleep(60)"), [1],
                                     metadata={"tests": ADD[:1]})
        scoring = asyncio.ensure_future(bridge.score_group([sleeper]))
        assert await _eventually(lambda: bool(_processes_of(UID))), "the candidate never ran"
        with pytest.raises(ScoringError) as caught:
            await scoring
        assert caught.value.reason == "timeout"
        assert await _eventually(lambda: not _processes_of(UID))
    assert len(_run_directories()) == 1  # its run directory: removed by the next run as UID
    assert run("print('next')").stdout == b"next\n"
    assert _run_directories() == []
