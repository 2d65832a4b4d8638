"""A fast stand-in for tuning the ``tools`` recipe: GRPO on the final answer alone.

In-process, no vLLM, no rollq: the first turn (the ``calc`` call) and the tool's turn are
teacher-forced as the warm start renders them (``ops.local.warm_start_tools.ToolTurns``); only
the answer (up to 3 tokens) is sampled, from the model itself, ``--group-size`` per
question. Reward 1 for the right answer then the end of the turn. The loss is the example
trainer's at ratio 1 (policy gradient with GRPO advantages, the k3 KL term to the start,
both averaged over the call's and the answer's tokens, as in the real sequence), AdamW,
gradient clip 1.0, an optional linear warm-up. Every 20 steps: greedy accuracy on the 122
training and 30 held-out questions, one JSON line.

What it does not model: sampled calls (at temperature 1 about 1 in 6 is malformed after
the 300-step warm start, and more as RL drifts), staleness, timing. So it answers "how many
steps does the answer take at this lr / batch / KL", not whether the call format survives
(docs/guides/demo-tools.md, the tuning runs).

    python -m bench.tools_answer_sim --model demo-out/tools-model --lr 1e-3 --kl 0.05
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollq.ops.local.warm_start import Encoder
from rollq.ops.local.warm_start_tools import ToolTurns
from rollq.producers.envs.tools import TOOLS_CHAT_TEMPLATE, calc_records


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True,
                        help="a tools warm start (rollq demo --task tools writes OUT/tools-model)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--groups", type=int, default=8, help="questions a step")
    parser.add_argument("--group-size", type=int, default=8, help="answers a question")
    parser.add_argument("--kl", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class AnswerSim:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.set_num_threads(1)
        torch.manual_seed(args.seed)
        self.rng = random.Random(args.seed)
        self.turns = ToolTurns(Encoder(Path(args.model), TOOLS_CHAT_TEMPLATE))
        self.end, self.pad = self.turns.encoder.end, self.turns.encoder.pad
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        self.reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)

    def padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        return ids, mask

    @torch.no_grad()
    def answers(self, prefixes: list[list[int]], greedy: bool) -> list[list[int]]:
        """Up to 3 tokens after each prefix, sampled (or greedy) from the model."""
        self.model.eval()
        outs: list[list[int]] = [[] for _ in prefixes]
        for _ in range(3):
            live = [i for i, o in enumerate(outs) if not (o and o[-1] == self.end)]
            if not live:
                break
            rows = [prefixes[i] + outs[i] for i in live]
            ids, mask = self.padded(rows)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            last = logits[torch.arange(len(live)), torch.tensor([len(r) - 1 for r in rows])]
            if greedy:
                chosen = last.argmax(-1)
            else:
                probs = torch.softmax(last.float() / self.args.temperature, -1)
                chosen = torch.multinomial(probs, 1).squeeze(-1)
            for j, i in enumerate(live):
                outs[i].append(int(chosen[j]))
        self.model.train()
        return outs

    def right(self, out: list[int], record: dict[str, Any]) -> bool:
        if not out or out[-1] != self.end:
            return False
        text = self.turns.encoder.tokenizer.decode(out[:-1])  # "15" may be one token
        return text == str(int(record["answer"]))

    def accuracy(self, records: list[dict[str, Any]]) -> float:
        outs = self.answers([self.turns.turns(r)[2] for r in records], greedy=True)
        return sum(self.right(o, r) for o, r in zip(outs, records, strict=True)) / len(records)

    def step(self, step: int, questions: list[dict[str, Any]]) -> tuple[float, float]:
        records = [q for q in questions for _ in range(self.args.group_size)]
        outs = self.answers([self.turns.turns(r)[2] for r in records], greedy=False)
        rewards = torch.tensor([float(self.right(o, r))
                                for o, r in zip(outs, records, strict=True)])
        grouped = rewards.view(-1, self.args.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True))
                      / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
        rows, masks = [], []
        for out, record in zip(outs, records, strict=True):
            first, call, second = self.turns.turns(record)
            rows.append(second + out)  # the call and the answer trainable, the tool's turn not
            mask = [0.0] * len(rows[-1])
            mask[len(first):len(first) + len(call)] = [1.0] * len(call)
            mask[len(second):] = [1.0] * len(out)
            masks.append(mask)
        ids, attention = self.padded(rows)
        trained = torch.zeros(ids.shape)
        for i, mask in enumerate(masks):
            trained[i, :len(mask)] = torch.tensor(mask)
        labels, trained = ids[:, 1:], trained[:, 1:]

        def logprobs(model: Any) -> torch.Tensor:
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

        policy = logprobs(self.model)
        with torch.no_grad():
            reference = logprobs(self.reference)
        tokens = trained.sum()
        ratio = torch.exp(policy - policy.detach())
        loss = -(advantages[:, None] * ratio * trained).sum() / tokens
        log_ratio = reference - policy
        kl = ((torch.exp(log_ratio) - log_ratio - 1) * trained).sum() / tokens
        loss = loss + self.args.kl * kl
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        warm = min(1.0, step / self.args.warmup) if self.args.warmup else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.args.lr * warm
        self.optimizer.step()
        return float(rewards.mean()), float(kl.detach())


def main() -> None:
    args = parse_args()
    sim = AnswerSim(args)
    train, heldout = calc_records("train"), calc_records("heldout")
    order: list[dict[str, Any]] = []
    batch_accuracy: list[float] = []
    started = time.monotonic()
    print(json.dumps({"args": vars(args)}))
    print(json.dumps({"step": 0, "train": sim.accuracy(train), "held": sim.accuracy(heldout)}),
          flush=True)
    for step in range(1, args.steps + 1):
        questions = []
        for _ in range(args.groups):
            if not order:
                order = list(train)
                sim.rng.shuffle(order)
            questions.append(order.pop())
        reward, kl = sim.step(step, questions)
        batch_accuracy.append(reward)
        if step % 20 == 0 or step <= 3:
            print(json.dumps({"step": step, "batch_acc20": round(sum(batch_accuracy[-20:]) / 20, 3),
                              "kl": round(kl, 3), "train": sim.accuracy(train),
                              "held": sim.accuracy(heldout),
                              "seconds": round(time.monotonic() - started)}), flush=True)


if __name__ == "__main__":
    main()
