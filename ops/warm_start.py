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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from producers.envs.sums import CHANCE, sums_records

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


class _Encoder:
    """Token ids of prompts and completions with the model's own tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)  # its stubs return unions
        self.tokenizer = tokenizer
        self.end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.pad = int(self.tokenizer.pad_token_id or 0)

    def prompt(self, question: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
        return [int(i) for i in ids]

    def text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


def _batch(rows: Sequence[tuple[list[int], list[int], list[int]]], pad: int) -> dict[str, Any]:
    """Right-padded input ids, attention mask, ``completion`` (1 on every completion token)
    and ``weights`` (the row's own per-completion-token weights)."""
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
        weights[row, len(prompt):len(tokens)] = torch.tensor(weight, dtype=torch.float)
        completion_mask[row, len(prompt):len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": attention, "weights": weights,
            "completion": completion_mask}


def _token_losses(model: Any, batch: dict[str, Any]) -> Any:
    """Cross-entropy of every token given the ones before it, shape [B, T-1]."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), batch["input_ids"][:, 1:], reduction="none")


def _example(encoder: _Encoder, record: dict[str, Any], answer: int,
             ) -> tuple[list[int], list[int], list[int]]:
    """(prompt, completion, format mask): the mask is 1 on format tokens, 0 on the answer."""
    a, b = int(record["a"]), int(record["b"])
    before = encoder.text(format_completion(a, b, answer).split("{")[0] + "{")
    digits = encoder.text(str(answer))
    after = [*encoder.text("}"), encoder.end]
    completion = before + digits + after
    mask = [1] * len(before) + [0] * len(digits) + [1] * len(after)
    return encoder.prompt(str(record["problem"])), completion, mask


def answer_probability(model: Any, encoder: _Encoder, records: Sequence[dict[str, Any]]) -> float:
    """Mean probability of the correct sum (digits and the closing brace) after the format
    prefix, teacher-forced; 1/19 for a model that guesses uniformly."""
    import torch

    rows = []
    for record in records:
        prompt, completion, mask = _example(encoder, record, int(record["a"]) + int(record["b"]))
        answer_and_brace = [1 - m for m in mask]
        answer_and_brace[mask.index(1, mask.index(0))] = 1  # the "}" right after the digits
        rows.append((prompt, completion, answer_and_brace))
    batch = _batch(rows, encoder.pad)
    with torch.no_grad():
        losses = _token_losses(model, batch)
    log_p = -(losses * batch["weights"][:, 1:]).sum(dim=1)
    return float(log_p.exp().mean())


def warm_start(model_dir: Path, out: Path, options: WarmStartOptions | None = None, *,
               source: str | Path | None = None) -> WarmStartReport:
    """Fine-tune the model in ``model_dir`` on the format with random answers; write the
    result (HF layout, tokenizer included) and ``warm_start.json`` into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    options = options or WarmStartOptions()
    started = time.monotonic()
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    encoder = _Encoder(model_dir)
    train = sums_records("train", source)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr)
    recent: list[float] = []
    for _ in range(options.steps):
        rows = [_example(encoder, rng.choice(train), rng.choice(ANSWERS))
                for _ in range(options.batch)]
        batch = _batch(rows, encoder.pad)
        losses = _token_losses(model, batch)
        # The loss covers the whole completion, the random answer included: that is what
        # makes the answer distribution uniform. The format part is reported separately.
        completion, weights = batch["completion"][:, 1:], batch["weights"][:, 1:]
        loss = (losses * completion).sum() / completion.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        format_loss = float((losses.detach() * weights).sum() / weights.sum())
        recent = [*recent, format_loss][-20:]
    model.eval()
    report = WarmStartReport(
        options=asdict(options), seconds=round(time.monotonic() - started, 1),
        format_loss=sum(recent) / max(1, len(recent)),
        train_answer_probability=answer_probability(model, encoder, train),
        heldout_answer_probability=answer_probability(model, encoder,
                                                      sums_records("heldout", source)))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)
    (out / "warm_start.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def load_report(out: Path, options: WarmStartOptions | None = None) -> WarmStartReport | None:
    """The report of a warm start already written to ``out`` with ``options``, if any."""
    path = out / "warm_start.json"
    if not path.exists() or not (out / "model.safetensors").exists():
        return None
    report = WarmStartReport(**json.loads(path.read_text()))
    return report if report.options == asdict(options or WarmStartOptions()) else None


def describe(report: WarmStartReport) -> str:
    """One line for humans."""
    return (f"warm start: {report.options['steps']} steps in {report.seconds:.0f}s, format "
            f"loss {report.format_loss:.3f} nats/token; P(correct sum) train "
            f"{report.train_answer_probability:.3f}, held-out "
            f"{report.heldout_answer_probability:.3f} (chance {report.chance:.3f}, "
            f"{math.log(1 / report.chance):.2f} nats)")
