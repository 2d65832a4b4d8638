"""An Atropos env file as many are written: ``config_init`` returns one server config,
not a list. atroposlib 0.4.0 alone sends such an env's model calls to
``localhost:9004..9007`` whatever ``--openai.*`` says; started through ``rollq
atropos-env`` (docs/guides/atropos.md), the flags count:

    rollq atropos-env tests/atropos/lone_server_env.py serve \\
        --env.rollout_server_url http://API --openai.server_type vllm \\
        --openai.base_url http://API/inference/v1 --openai.model_name MODEL \\
        --openai.tokenizer_name TOKENIZER

Everything else is ``tests.atropos.atropos_envs.ManagedSumsEnv`` (token-exact, through
atroposlib's ``managed_server``), but the scores: they alternate 1, 0 within a group, so
atroposlib never skips a group as all-equal on the fake vLLM's random replies.
"""

from __future__ import annotations

from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnvConfig, ScoredDataGroup

from tests.atropos.atropos_envs import ManagedSumsEnv


class LoneServerSumsEnv(ManagedSumsEnv):
    name = "lone_server_sums"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, APIServerConfig]:  # type: ignore[override]
        config, _ = super().config_init()
        return config, APIServerConfig(model_name="default", timeout=120)

    async def collect_trajectories(
            self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list[Any]]:
        group, backlog = await super().collect_trajectories(item)
        group["scores"] = [float(i % 2 == 0) for i in range(len(group["scores"]))]
        return group, backlog


if __name__ == "__main__":
    LoneServerSumsEnv.cli()
