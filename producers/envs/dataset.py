"""Single-turn dataset envs: GSM8K-style and MATH-style problems, one request per group.

Records come from local JSONL or parquet, or from Hugging Face ``datasets`` (see
``load_records``). The prompt is either a chat conversation sent to
``/v1/chat/completions`` (the server applies the model's chat template; ``prompt_ids`` come
back in the response) or a plain text template sent to ``/v1/completions``. Either way the
group is one request with ``n = group_size``.

Metadata (what the scorer reads):

- ``answer``: the gold final answer: GSM8K's number after ``####`` (commas removed), or
  MATH's ``\\boxed{...}`` (the last one in the solution). This is what the accuracy
  reward's default ``gold_field`` reads; both its ``gsm8k`` and ``math`` kinds parse it.
- ``gold``: the bare final answer (the number, or the boxed content without ``\\boxed``).
- ``solution``: the dataset's full worked answer, verbatim.
- ``index``: the item index.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollq.producers.envs.base import Item, PolicyVersion, RecordItems, Rollout
from rollq.producers.inference import InferencePool, MessageDict, SamplingParams
from rollq.schemas import ConfigError, ContractError

Record = dict[str, Any]


def load_records(source: str | Path, *, split: str = "train", subset: str | None = None,
                 data_files: str | Sequence[str] | None = None) -> list[Record]:
    """Rows of a dataset, as dicts.

    ``source`` is a local ``.jsonl``/``.json`` (JSON lines or one array) or ``.parquet`` file
    (needs ``pyarrow``), or else a Hugging Face ``datasets`` name or path (needs
    ``datasets``), loaded with ``subset``, ``split`` and ``data_files``.
    """
    path = Path(source)
    if data_files is None and path.suffix in (".jsonl", ".json", ".parquet") and not path.is_file():
        raise ConfigError(f"dataset file {str(source)!r} does not exist; --env gsm8k without "
                          "--env-option source=... uses its built-in sample (200 GSM8K-style "
                          "problems, producers/data/gsm8k_sample.jsonl)")
    if data_files is None and path.suffix in (".jsonl", ".json") and path.is_file():
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):  # a .json array rather than JSON lines
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if data_files is None and path.suffix == ".parquet" and path.is_file():
        try:
            import pyarrow.parquet as parquet  # optional dependency
        except ImportError as exc:
            raise ConfigError(f"reading {path.name} needs pyarrow: pip install pyarrow") from exc
        return list(parquet.read_table(path).to_pylist())
    try:
        import datasets  # optional dependency
    except ImportError as exc:
        raise ConfigError(f"{str(source)!r} is not a local .jsonl/.parquet file; loading it "
                          "from Hugging Face needs the datasets package") from exc
    try:
        loaded = datasets.load_dataset(str(source), subset, split=split, data_files=data_files)
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        # datasets' own errors for a missing name/path, a bad split, or an unreachable hub
        raise ConfigError(f"cannot load dataset {str(source)!r}: {exc}") from exc
    return [dict(row) for row in loaded]


_GSM8K_NUMBER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def parse_gsm8k_answer(answer: str) -> str | None:
    """The final number of a GSM8K answer (after the last ``####``), commas and ``$``
    removed; None if there is no ``####``."""
    if "####" not in answer:
        return None
    match = _GSM8K_NUMBER.search(answer[answer.rindex("####"):])
    return match.group(1).replace(",", "").replace("$", "").strip() if match else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced); None if there is none."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position]
    return None


@dataclass(frozen=True)
class RecordFormat:
    """How to read one dataset shape: the question field and the gold answer."""

    question_field: str
    solution_field: str
    gold_of: Callable[[str], str | None]
    """Bare final answer from the solution text."""
    answer_of: Callable[[str], str]
    """The ``answer`` metadata value from the bare final answer."""

    def metadata(self, record: Record, index: int) -> dict[str, Any]:
        solution = str(record[self.solution_field])
        gold = self.gold_of(solution)
        if gold is None:
            raise ContractError(f"item {index}: no final answer in {self.solution_field!r}")
        return {"answer": self.answer_of(gold), "gold": gold, "solution": solution,
                "index": index}


GSM8K = RecordFormat("question", "answer", parse_gsm8k_answer, lambda gold: gold)
"""``question`` + ``answer`` ending in ``#### N``."""
MATH = RecordFormat("problem", "solution", last_boxed, lambda gold: f"\\boxed{{{gold}}}")
"""``problem`` + ``solution`` with a final ``\\boxed{}``."""


@dataclass(frozen=True)
class PromptStyle:
    """How a record becomes a prompt.

    - ``mode``: ``chat`` sends ``[system?, user]`` messages to ``/v1/chat/completions``;
      ``completion`` sends ``template`` text to ``/v1/completions``.
    - ``template``: format string over the record's fields (``{question}``, ``{problem}``…);
      the user message in chat mode, the whole prompt in completion mode. None: the
      question field alone.
    - ``system_prompt``: chat mode only; None sends no system message.
    """

    mode: Literal["chat", "completion"] = "chat"
    template: str | None = None
    system_prompt: str | None = None

    def render(self, fields: dict[str, Any], question_field: str) -> str | list[MessageDict]:
        """The prompt text (completion mode) or messages (chat mode) of a record whose
        question is under ``question_field``; a template naming a missing field is a
        ``ConfigError``."""
        template = self.template or "{" + question_field + "}"
        try:
            text = template.format(**fields)
        except KeyError as exc:
            raise ConfigError(f"prompt template names a missing field {exc}") from exc
        if self.mode == "completion":
            return text
        messages: list[MessageDict] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        return [*messages, {"role": "user", "content": text}]


async def generate_group(prompt: str | list[MessageDict], pool: InferencePool, *,
                         group_size: int, sampling: SamplingParams,
                         policy_version: PolicyVersion, metadata: dict[str, Any]) -> Rollout:
    """One single-turn group: ``prompt`` (text: ``/v1/completions``; messages:
    ``/v1/chat/completions``) sampled ``group_size`` times in one request, stamped with the
    policy version read just before."""
    version = await policy_version()
    if isinstance(prompt, str):
        samples = await pool.complete(prompt, n=group_size, params=sampling)
    else:
        samples = await pool.chat(prompt, n=group_size, params=sampling)
    return Rollout(
        prompt_ids=samples[0].prompt_ids,
        completions=[sample.to_completion(version) for sample in samples],
        prompt_text=prompt if isinstance(prompt, str) else prompt[-1]["content"],
        prompt_messages=None if isinstance(prompt, str) else prompt,
        metadata=metadata,
    )


@dataclass
class DatasetEnv(RecordItems):
    """A single-turn env over in-memory records (see the module docstring)."""

    name: str
    records: list[Record]
    format: RecordFormat
    style: PromptStyle = field(default_factory=PromptStyle)

    def __post_init__(self) -> None:
        if not self.records:
            raise ConfigError(f"env {self.name!r} has no records")
        missing = {self.format.question_field, self.format.solution_field} - set(self.records[0])
        if missing:
            raise ConfigError(f"env {self.name!r}: records lack fields {sorted(missing)}")

    def prompt(self, item: Item) -> str | list[MessageDict]:
        """The prompt text (completion mode) or messages (chat mode) of an item."""
        return self.style.render(item.fields, self.format.question_field)

    async def rollout(self, item: Item, pool: InferencePool, *, group_size: int,
                      sampling: SamplingParams, policy_version: PolicyVersion) -> Rollout:
        metadata = self.format.metadata(item.fields, item.index)
        return await generate_group(self.prompt(item), pool, group_size=group_size,
                                    sampling=sampling, policy_version=policy_version,
                                    metadata=metadata)


def gsm8k_env(source: str | Path, *, name: str = "gsm8k", style: PromptStyle | None = None,
              **load_options: Any) -> DatasetEnv:
    """A GSM8K-style env from a local file or a Hugging Face dataset."""
    return DatasetEnv(name, load_records(source, **load_options), GSM8K, style or PromptStyle())


def math_env(source: str | Path, *, name: str = "math", style: PromptStyle | None = None,
             **load_options: Any) -> DatasetEnv:
    """A MATH-style env from a local file or a Hugging Face dataset."""
    return DatasetEnv(name, load_records(source, **load_options), MATH, style or PromptStyle())
