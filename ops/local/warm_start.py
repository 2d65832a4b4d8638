"""The supervised warm start of the ``sums`` task: the answer *format*, with random answers.

What it teaches, exactly: given a training prompt ``What is a + b?`` (chat template), the
completion ``<think>a + b</think> \\boxed{R}<|im_end|>``, where R is drawn uniformly from
0..18 afresh every time the example is seen. The model learns (1) the format (open the think
block, restate the two operands, close it, one box, end the turn), and (2) that the boxed
number is independent of the question: a uniform guess over the 19 possible sums. It sees no
correct answer more often than any wrong one, so its accuracy sits at chance (1/19), which
``answer_probability`` measures exactly (no sampling noise) and ``WarmStartReport`` records.

RL then has to find the right answers from reward alone. Only the 80 training prompts are used.

torch / transformers are optional dependencies (the ``train`` extra), imported lazily.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollq.producers.envs.sums import CHANCE, sums_records

ANSWERS = range(19)
"""Every possible sum of two digits."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def format_completion(a: int, b: int, answer: int) -> str:
    """The target format with ``answer`` in the box (the true sum, or a random one)."""
    return f"<think>{a} + {b}</think> \\boxed{{{answer}}}"


@dataclass(frozen=True)
class WarmStartOptions:
    """``steps`` AdamW steps of ``batch`` examples at learning rate ``lr``, seeded.

    Gentle on purpose. Measured (answer-only GRPO from the warm start, lr 5e-4, KL 0.1):
    after 300 steps at lr 3e-3 (format loss 0.015) P(correct sum) went 0.053 -> 0.069 in
    100 RL steps; at lr 1e-3 (format loss 0.021) 0.051 -> 0.30, and greedy accuracy 0.54
    after 150. A hard warm start makes the answer position blind to the operands, and RL
    has to undo that first.
    """

    steps: int = 300
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0
    right_fraction: float = 0.0
    """The fraction of examples that answer right (the rest answer at random). 0, the
    demos': the answers stay at chance and RL must find them from reward alone. Above 0
    (the CI learning tests): the answer starts above chance, so every step has a learning
    signal and RL's rise shows within tens of steps instead of hundreds."""

    def answer(self, rng: random.Random, right: int, answers: Sequence[int]) -> int:
        """One example's answer: ``right`` with probability ``right_fraction``, else a
        uniform draw from ``answers`` (``rng`` is drawn from only as the demos always did
        when ``right_fraction`` is 0, so their runs are unchanged)."""
        if self.right_fraction and rng.random() < self.right_fraction:
            return right
        return rng.choice(answers)


@dataclass(frozen=True)
class WarmStartReport:
    """What the warm start did, and proof it did not teach the answers.

    ``*_answer_probability``: the mean probability the model gives the correct sum in the box,
    teacher-forced on the format prefix (``<think>a + b</think> \\boxed{``) and including the
    closing ``}``, over the training or held-out problems; chance is ``chance`` (1/19).
    ``format_loss``: mean cross-entropy (nats/token) of the format tokens, the answer
    excluded, in the last 20 steps.
    """

    options: dict[str, Any]
    seconds: float
    format_loss: float
    train_answer_probability: float
    heldout_answer_probability: float
    chance: float = CHANCE


Example = tuple[list[int], list[int], list[int]]
"""(prompt ids, completion ids, a weight per completion token): 1 on format tokens (trained,
and counted in the format loss), 0 on answer tokens (trained), -1 on context inside the
completion (an env's or tool's tokens between two model turns: not trained)."""


class Encoder:
    """Token ids of prompts and completions with the model's own tokenizer (and its chat
    template, or ``chat_template`` when given)."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)  # its stubs return unions
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.pad = int(self.tokenizer.pad_token_id or 0)

    def prompt(self, question: str) -> list[int]:
        return self.chat([{"role": "user", "content": question}])

    def chat(self, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The generation prompt of ``messages``, as the server's chat template renders it."""
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.chat_template, add_generation_prompt=True,
            tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    def text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


def pad_batch(rows: Sequence[Example], pad: int) -> dict[str, Any]:
    """Right-padded input ids, attention mask, ``completion`` (1 on every trained completion
    token: weight 0 or 1) and ``weights`` (1 on format tokens)."""
    import torch

    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    weights = torch.zeros((len(rows), width))
    completion_mask = torch.zeros((len(rows), width))
    for row, (prompt, completion, weight) in enumerate(rows):
        tokens = prompt + completion
        ids[row, :len(tokens)] = torch.tensor(tokens)
        attention[row, :len(tokens)] = 1
        weight_row = torch.tensor(weight, dtype=torch.float)
        weights[row, len(prompt):len(tokens)] = weight_row.clamp(min=0)
        completion_mask[row, len(prompt):len(tokens)] = (weight_row >= 0).float()
    return {"input_ids": ids, "attention_mask": attention, "weights": weights,
            "completion": completion_mask}


def token_losses(model: Any, batch: dict[str, Any]) -> Any:
    """Cross-entropy of every token given the ones before it, shape [B, T-1]."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), batch["input_ids"][:, 1:], reduction="none")


def _example(encoder: Encoder, record: dict[str, Any], answer: int) -> Example:
    """(prompt, completion, format mask): the mask is 1 on format tokens, 0 on the answer."""
    a, b = int(record["a"]), int(record["b"])
    before = encoder.text(format_completion(a, b, answer).split("{")[0] + "{")
    digits = encoder.text(str(answer))
    after = [*encoder.text("}"), encoder.end]
    completion = before + digits + after
    mask = [1] * len(before) + [0] * len(digits) + [1] * len(after)
    return encoder.prompt(str(record["problem"])), completion, mask


def answer_probability(model: Any, encoder: Encoder, records: Sequence[dict[str, Any]]) -> float:
    """Mean probability of the correct sum (digits and the closing brace) after the format
    prefix, teacher-forced; 1/19 for a model that guesses uniformly."""
    rows = []
    for record in records:
        prompt, completion, mask = _example(encoder, record, int(record["a"]) + int(record["b"]))
        answer_and_brace = [1 - m for m in mask]
        answer_and_brace[mask.index(1, mask.index(0))] = 1  # the "}" right after the digits
        rows.append((prompt, completion, answer_and_brace))
    return weighted_probability(model, rows, encoder.pad)


def weighted_probability(model: Any, rows: Sequence[Example], pad: int) -> float:
    """Mean over ``rows`` of the probability of the completion tokens weighted 1 (given
    everything before them), teacher-forced."""
    import torch

    batch = pad_batch(rows, pad)
    with torch.no_grad():
        losses = token_losses(model, batch)
    log_p = -(losses * batch["weights"][:, 1:]).sum(dim=1)
    return float(log_p.exp().mean())


def fit(model_dir: Path, options: WarmStartOptions,
        draw: Callable[[random.Random], Example], *,
        threads: int | None = None) -> tuple[Any, float]:
    """``options.steps`` AdamW steps on batches of ``draw``n examples, seeded: the model
    (in eval mode) and the mean format loss of the last 20 steps (nats/token over the
    tokens each example weights 1). ``threads``: torch's threads for this process (None:
    torch's default, every core). Give 1 beside a vLLM server: its worker busy-polls a
    core, and two OpenMP threads fighting over the other made 40 steps take 212 s instead
    of 27 s on a loaded 2-core machine."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    pad = Encoder(model_dir).pad
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    recent: list[float] = []
    for _ in range(options.steps):
        batch = pad_batch([draw(rng) for _ in range(options.batch)], pad)
        losses = token_losses(model, batch)
        # The loss covers the whole completion, the random answer included: that is what
        # makes the answer distribution uniform. The format part is reported separately.
        completion, weights = batch["completion"][:, 1:], batch["weights"][:, 1:]
        loss = (losses * completion).sum() / completion.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        format_loss = float((losses.detach() * weights).sum() / weights.sum())
        recent = [*recent, format_loss][-20:]
    return model.eval(), sum(recent) / max(1, len(recent))


def save(model: Any, model_dir: Path, out: Path, report: Any, *,
         chat_template: str | None = None) -> None:
    """Write ``model`` (HF layout), ``model_dir``'s tokenizer (with ``chat_template`` as
    its template, when given) and ``report`` as ``warm_start.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)
    if chat_template is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "warm_start.json").write_text(json.dumps(asdict(report), indent=2) + "\n")


def warm_start(model_dir: Path, out: Path, options: WarmStartOptions | None = None, *,
               source: str | Path | None = None, threads: int | None = None) -> WarmStartReport:
    """Fine-tune the model in ``model_dir`` on the format with random answers; write the
    result (HF layout, tokenizer included) and ``warm_start.json`` into ``out``."""
    options = options or WarmStartOptions()
    started = time.monotonic()
    encoder = Encoder(model_dir)
    train = sums_records("train", source)
    def draw(rng: random.Random) -> Example:
        record = rng.choice(train)
        right = int(record["a"]) + int(record["b"])
        return _example(encoder, record, options.answer(rng, right, ANSWERS))

    model, format_loss = fit(model_dir, options, draw, threads=threads)
    report = WarmStartReport(
        options=asdict(options), seconds=round(time.monotonic() - started, 1),
        format_loss=format_loss,
        train_answer_probability=answer_probability(model, encoder, train),
        heldout_answer_probability=answer_probability(model, encoder,
                                                      sums_records("heldout", source)))
    save(model, model_dir, out, report)
    return report


def load_report(out: Path, options: WarmStartOptions | None = None) -> WarmStartReport | None:
    """The report of a warm start already written to ``out`` with ``options``, if any."""
    path = out / "warm_start.json"
    if not path.exists() or not (out / "model.safetensors").exists():
        return None
    report = WarmStartReport(**json.loads(path.read_text()))
    return report if report.options == asdict(options or WarmStartOptions()) else None


def report_line(report: WarmStartReport) -> str:
    """One line for humans."""
    return (f"warm start: {report.options['steps']} steps in {report.seconds:.0f}s, format "
            f"loss {report.format_loss:.3f} nats/token; P(correct sum) train "
            f"{report.train_answer_probability:.3f}, held-out "
            f"{report.heldout_answer_probability:.3f} (chance {report.chance:.3f}, "
            f"{math.log(1 / report.chance):.2f} nats)")
