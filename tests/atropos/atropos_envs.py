"""Two Atropos environments written as Atropos users write them (``BaseEnv`` subclasses),
for the serve-mode tests: run them with atroposlib's own CLI,

    python -m tests.atropos.atropos_envs sums serve --env.rollout_server_url URL
    python -m tests.atropos.atropos_envs two_step serve --env.rollout_server_url URL

- ``sums``: single-turn, GSM8K-style: one question, ``group_size`` completions in one
  request (``n``), scored 1.0 when the ``####`` answer is right;
- ``two_step``: multi-step: the model answers, the env asks a follow-up, the model answers
  again; ``collect_trajectory`` per rollout (atroposlib's default ``collect_trajectories``
  gathers the group), every assistant turn trained, scored on the last answer.

Inference goes to the ``openai`` server at ``$ROLLQ_TEST_OPENAI_URL`` (the loopback fake,
``tests.atropos.fake_openai``); the tokenizer is read from ``$ROLLQ_TEST_TOKENIZER``.

Token-exact twins (``managed_sums``, ``managed_two_step``) build their groups with
atroposlib's ``managed_server`` (token ids and logprobs from the server), as atroposlib
recommends for training data: their ``vllm`` server is ``$ROLLQ_TEST_INFERENCE_URL`` (the
``/inference/v1`` of ``rollq atropos-api --inference``), and as rollq workers
(``--env atropos:tests.atropos.atropos_envs:ManagedSumsEnv``) the worker's pool.
Both re-tokenise the chat, as atroposlib's GSM8K env does, with ``tokenize`` below:
atroposlib 0.4.0's ``tokenize_for_trainer`` breaks under transformers 5, whose
``apply_chat_template`` returns a ``BatchEncoding`` unless ``return_dict=False`` (the env
then fails to JSON-encode its group and never posts it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any

from atroposlib.envs.base import (
    APIServerConfig,
    BaseEnv,
    BaseEnvConfig,
    ScoredDataGroup,
    ScoredDataItem,
)

QUESTIONS = [(a, b) for a in range(1, 6) for b in range(1, 6)]
GROUP_SIZE = 4


def tokenize(tokenizer: Any, chat: list[dict[str, str]], *,
             all_assistant_turns: bool = False) -> tuple[list[int], list[int]]:
    """Tokens and labels of a chat, as atroposlib's ``tokenize_for_trainer``: -100 over the
    prompt (every non-assistant message with ``all_assistant_turns``), else the token."""
    tokens: list[int] = tokenizer.apply_chat_template(chat, return_dict=False)
    if not all_assistant_turns:
        prefix = len(tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True,
                                                   return_dict=False))
        return tokens, [-100] * prefix + tokens[prefix:]
    masks = [-100] * len(tokens)
    for end, message in enumerate(chat, start=1):
        if message["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(chat[:end - 1],
                                                      add_generation_prompt=True,
                                                      return_dict=False))
            stop = len(tokenizer.apply_chat_template(chat[:end], return_dict=False))
            masks[start:stop] = tokens[start:stop]
    return tokens, masks


def _score(reply: str, right: int) -> float:
    found = re.search(r"####\s*(-?\d+)", reply)
    return 1.0 if found is not None and int(found.group(1)) == right else 0.0


class _Env(BaseEnv):
    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        config = BaseEnvConfig(
            group_size=GROUP_SIZE, use_wandb=False, max_token_length=512,
            tokenizer_name=os.environ["ROLLQ_TEST_TOKENIZER"], total_steps=10_000,
            max_num_workers=2, max_batches_offpolicy=4, steps_per_eval=0,
            wandb_name=cls.name, include_messages=True)
        server = APIServerConfig(
            server_type="openai", base_url=os.environ["ROLLQ_TEST_OPENAI_URL"],
            api_key="x", model_name="fake", health_check=False, timeout=30)
        return config, [server]

    async def setup(self) -> None:
        self.position = 0

    async def get_next_item(self) -> tuple[int, int]:
        item = QUESTIONS[self.position % len(QUESTIONS)]
        self.position += 1
        return item

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


class SumsEnv(_Env):
    """Single turn: ``n = group_size`` completions of one question."""

    name = "sums"

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list]:
        a, b = item
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        reply = await self.server.chat_completion(messages=prompt, n=self.config.group_size,
                                                  max_tokens=32)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        for choice in reply.choices:
            chat = [*prompt, {"role": "assistant", "content": choice.message.content}]
            tokens, masks = tokenize(self.tokenizer, chat)
            group["tokens"].append(tokens)
            group["masks"].append(masks)
            group["scores"].append(_score(choice.message.content, a + b))
            group["messages"].append(chat)
        return group, []


class TwoStepEnv(_Env):
    """Two steps: answer, follow-up question, answer again (scored on the second)."""

    name = "two_step"

    async def collect_trajectory(self, item: tuple[int, int]) -> tuple[ScoredDataItem, list]:
        a, b = item
        chat: list[dict[str, str]] = [{"role": "user", "content": f"What is {a} + {b}?"}]
        for follow_up in (None, f"Now add 10 to {a} + {b}."):
            if follow_up is not None:
                chat.append({"role": "user", "content": follow_up})
            reply = await self.server.chat_completion(messages=chat, n=1, max_tokens=32)
            chat.append({"role": "assistant", "content": reply.choices[0].message.content})
        tokens, masks = tokenize(self.tokenizer, chat, all_assistant_turns=True)
        return ScoredDataItem(tokens=tokens, masks=masks,
                              scores=_score(chat[-1]["content"], a + b + 10),
                              messages=chat), []


def _partial(reply: str, right: int) -> float:
    """GSM8K-style score: 1.0 for the right ``####`` answer, else the fraction of digit
    characters (partial credit, so an untrained model's groups still vary)."""
    if _score(reply, right):
        return 1.0
    return sum(c.isdigit() for c in reply) / max(1, len(reply)) / 2


def posted_digest(tokens: list[list[int]]) -> str:
    """What identifies a group across the wire: a digest of its sequences' tokens."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()


class _ManagedEnv(_Env):
    async def _send_scored_data_to_api(self, scored_data: Any) -> None:
        """atroposlib's post; then, when it did not raise (the API answered), the group's
        digest is appended to ``$ROLLQ_TEST_POSTED``: what the API acknowledged."""
        await super()._send_scored_data_to_api(scored_data)
        path = os.environ.get("ROLLQ_TEST_POSTED")
        if path:
            groups = scored_data if isinstance(scored_data, list) else [scored_data]
            with open(path, "a") as out:  # noqa: ASYNC230  a few bytes, test bookkeeping
                for group in groups:
                    out.write(posted_digest(group["tokens"]) + "\n")

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        config, _ = super().config_init()
        server = APIServerConfig(
            server_type="vllm", base_url=os.environ.get("ROLLQ_TEST_INFERENCE_URL", ""),
            api_key="x", model_name="rollq-tiny", tokenizer_name=config.tokenizer_name,
            timeout=120)
        return config, [server]


class ManagedSumsEnv(_ManagedEnv):
    """Single turn, token-exact: ``n = group_size`` completions through ``managed_server``."""

    name = "managed_sums"

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list]:
        a, b = item
        prompt = [{"role": "user", "content": f"What is {a} + {b}? End with #### and the sum."}]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            reply = await managed.chat_completion(messages=prompt, n=self.config.group_size,
                                                  max_tokens=16, temperature=1.0)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[],
                                inference_logprobs=[])
        for choice, node in zip(reply.choices, nodes, strict=True):
            text = choice.message.content or ""
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(_partial(text, a + b))
            group["messages"].append([*prompt, {"role": "assistant", "content": text}])
        return group, []


class ManagedTwoStepEnv(_ManagedEnv):
    """Two steps, token-exact: the second call extends the first's tokens (env turn masked).
    Sends no ``inference_logprobs`` (rollq fills them from the server's)."""

    name = "managed_two_step"

    async def collect_trajectory(self, item: tuple[int, int]) -> tuple[ScoredDataItem, list]:
        a, b = item
        chat: list[dict[str, str]] = [{"role": "user", "content": f"What is {a} + {b}?"}]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            for follow_up in (None, f"Now add 10 to {a} + {b}."):
                if follow_up is not None:
                    chat.append({"role": "user", "content": follow_up})
                reply = await managed.chat_completion(messages=chat, n=1, max_tokens=12)
                chat.append({"role": "assistant",
                             "content": reply.choices[0].message.content or ""})
            node = managed.get_state()["nodes"][-1]
        return ScoredDataItem(tokens=node.tokens, masks=node.masked_tokens,
                              scores=_partial(chat[-1]["content"], a + b + 10),
                              messages=chat), []


class FilteringEnv(ManagedSumsEnv):
    """Catches every error and filters every item (returns no group), as atroposlib's own
    ``handle_env`` swallows errors: for the worker adapter's failure tests."""

    name = "filtering"

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[None, list]:
        try:
            await super().collect_trajectories(item)
        except Exception:  # what atroposlib envs do
            pass
        return None, []


ENVS: dict[str, type[_Env]] = {"sums": SumsEnv, "two_step": TwoStepEnv,
                               "managed_sums": ManagedSumsEnv,
                               "managed_two_step": ManagedTwoStepEnv}

if __name__ == "__main__":
    if os.environ.get("ROLLQ_TEST_ENV_LOG"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ENVS[sys.argv.pop(1)].cli()
