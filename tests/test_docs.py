"""Every snippet in README.md and docs/ against the real code, and the generated settings page.

- a ```yaml block that is a reward config (it has ``components`` or ``preset``) must load
  with the reward-config loader ``rollq score`` uses; every other YAML block must parse;
- every ```python block must compile; a block that starts with ``# file: NAME.py`` is a
  module the docs tell the reader to write: it is importable while the YAML is checked;
- every ``rollq …`` command in a ```bash / ```sh / ```shell / ```console block must parse
  with the real CLI parser (``ops.cli.build_parser``: parsed, never run);
- ``docs/reference/settings.md`` must equal what ``python -m rollq.ops.docs_settings`` writes.

A failing snippet is a docs bug: fix the page, not this test.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollq.consumers.scorer import RewardConfig
from rollq.consumers.scorer.bridge import RewardBridge
from rollq.ops.cli import build_parser
from rollq.ops.docs_settings import PAGE, render
from rollq.producers.envs.registry import make_env
from rollq.producers.inference import SamplingParams
from tests.agents.fake_agent_vllm import AgentFakeVLLM
from tests.agents.helpers import pool_of
from tests.scorer.helpers import make_sample

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
SHELLS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<language>[\w+-]*)")
MODULE_MARK = re.compile(r"^# file: (?P<name>\w+)\.py$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_in(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, dedented to their fence's indentation."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        index += 1
        while index < len(lines) and not lines[index].strip().startswith(fence):
            body.append(lines[index][indent:])
            index += 1
        blocks.append(Block(page, index - len(body), opening["language"].lower(),
                            "\n".join(body) + "\n"))
        index += 1
    return blocks


@cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(block for page in PAGES for block in blocks_in(page))


def blocks(*languages: str) -> list[Block]:
    return [block for block in all_blocks() if block.language in languages]


# ------------------------------------------------------------------------ the checkers


def reward_problem(text: str) -> str | None:
    """Why ``text`` is not a loadable reward config, or None; a YAML block that is no
    reward config only has to parse."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return f"not YAML: {exc}"
    if not (isinstance(document, dict) and {"components", "preset"} & set(document)):
        return None
    try:
        RewardConfig.from_mapping(document)
    except ValueError as exc:  # RewardConfigError is a ValueError
        return str(exc)
    return None


def rollq_commands(text: str, *, console: bool) -> Iterator[list[str]]:
    """The argument lists of every ``rollq`` command in a shell block: continuation lines
    joined, comments dropped, ``;``/``&&``/``||``/``|`` sequences split, leading
    ``NAME=value`` assignments skipped; in a console block only ``$ `` lines count."""
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set(";&|"):
                while command and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                    command.pop(0)
                if command and command[0] == "rollq":
                    yield command[1:]
                command = []
            else:
                command.append(token)


def command_problem(argv: list[str]) -> str | None:
    """Why ``rollq ARGV`` does not parse, or None (parsed only: nothing runs)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):  # `--help` exits 0
            return errors.getvalue().strip().splitlines()[-1]
    return None


# ------------------------------------------------------------- the checkers themselves


def test_the_checkers_catch_what_they_should() -> None:
    assert reward_problem("components: [{name: a, component: no_such_component}]")
    assert reward_problem("preset: r1\nadvantages: {method: nonsense}")
    assert reward_problem("components: [unclosed")
    assert reward_problem("components: [{name: a, component: char_fraction}]") is None
    assert reward_problem("services: {redis: {image: redis:7}}") is None  # not a reward
    assert list(rollq_commands("X=1 rollq feed --env gsm8k ; rollq status  # note\n"
                               "rollq workers \\\n  --group-size 8 && echo rollq",
                               console=False)) == [["feed", "--env", "gsm8k"], ["status"],
                                                   ["workers", "--group-size", "8"]]
    assert list(rollq_commands("$ rollq status --json\nrollq output line", console=True)) == [
        ["status", "--json"]]
    assert command_problem(["feed", "--no-such-flag"])
    assert command_problem(["no-such-command"])
    assert command_problem(["status", "--watch", "five"])
    assert command_problem(["feed", "--env", "gsm8k", "--epochs", "3"]) is None


def test_the_docs_hold_snippets_of_every_kind() -> None:
    """The checks below see what they should: a parser that found nothing passes nothing."""
    rewards = [b for b in blocks("yaml") if "components" in b.text or "preset:" in b.text]
    commands = [c for b in blocks(*SHELLS) for c in rollq_commands(
        b.text, console=b.language == "console")]
    assert len(rewards) >= 2, [b.where for b in rewards]
    assert len(blocks("python")) >= 5
    assert len(commands) >= 10, commands
    assert (ROOT / "README.md") in {b.page for b in blocks("python")}


# ------------------------------------------------------------------------ the snippets


@pytest.fixture
def modules_of_the_docs(tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ``# file: NAME.py`` modules of the docs written to a folder on ``sys.path``."""
    names = []
    for block in blocks("python"):
        mark = MODULE_MARK.match(block.text.splitlines()[0]) if block.text.strip() else None
        if mark:
            (tmp_path / f"{mark['name']}.py").write_text(block.text, encoding="utf-8")
            names.append(mark["name"])
            monkeypatch.delitem(sys.modules, mark["name"], raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_every_yaml_block_parses_and_every_reward_block_loads(
        modules_of_the_docs: list[str]) -> None:
    problems = {b.where: reward_problem(b.text) for b in blocks("yaml", "yml")}
    assert {where: why for where, why in problems.items() if why} == {}


def test_every_python_block_compiles() -> None:
    problems = {}
    for block in blocks("python", "py"):
        try:
            compile(block.text, block.where, "exec")
        except SyntaxError as exc:
            problems[block.where] = f"line {exc.lineno}: {exc.msg}"
    assert problems == {}


def test_every_rollq_command_parses_with_the_real_cli() -> None:
    problems = {}
    for block in blocks(*SHELLS):
        for argv in rollq_commands(block.text, console=block.language == "console"):
            why = command_problem(argv)
            if why:
                problems[f"{block.where}: rollq {shlex.join(argv)}"] = why
    assert problems == {}


async def test_the_quickstart_env_and_reward_run(modules_of_the_docs: list[str]) -> None:
    """The quickstart's own env and reward, end to end without Redis: the env rolls out a
    group on the fake vLLM through the episode client, and the reward config scores it."""
    assert "my_task" in modules_of_the_docs
    quickstart = [b for b in blocks("yaml") if b.page.name == "quickstart.md"]
    config = RewardConfig.from_mapping(yaml.safe_load(quickstart[0].text))
    env = make_env("my_task:Capitals")
    fake, prompts = AgentFakeVLLM(), []

    def model(prompt: str, number: int) -> str:
        prompts.append(prompt)
        return "Paris" if number % 2 == 0 else "Lyon, I think"

    fake.script = model

    async def version() -> int:
        return 0

    async with pool_of(fake) as pool:
        rollout: Any = await env.rollout(env.item(0), pool, group_size=2, policy_version=version,
                                         sampling=SamplingParams(max_tokens=16))
    texts = [completion.text for completion in rollout.completions]
    assert texts == ["Paris", "Lyon, I think"]
    assert all("What is the capital of France?" in prompt for prompt in prompts)
    samples = [make_sample(text, metadata=rollout.metadata) for text in texts]
    async with RewardBridge(config) as bridge:
        scored = await bridge.score_group(samples)
    assert list(scored.rewards) == [1.0, 0.0]
    assert scored.advantages is not None and scored.advantages[0] > 0 > scored.advantages[1]


def test_the_settings_page_is_current() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/reference/settings.md is stale: run python -m rollq.ops.docs_settings")


def test_the_settings_page_holds_every_field_with_its_docstring() -> None:
    from rollq.ops.settings import WorkerSettings

    page = render()
    for name in WorkerSettings.model_fields:
        if name != "section":
            assert f"### `{name}`" in page
    assert "env `ROLLQ_MAX_ENTRY_BYTES` · YAML `workers: max_entry_bytes`" in page
    assert "dead-lettered as\n`entry_too_large`" in page  # the field's docstring, in Markdown
    assert "### `prefetch`" in page  # the trainer SDK's dataclass fields too


def test_the_readme_links_point_at_pages_that_exist() -> None:
    """mkdocs checks the links between docs pages; the README is outside the site."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 10
    assert [target for target in local if not (ROOT / target).is_file()] == []
