"""The ``smollm2`` task of the demo: a real pretrained model learns through rollq.

SmolLM2-135M-Instruct (``ops.local.smollm2``: fetched from PyPI, converted once) answers
the ``sums`` problems (``producers.envs.sums``: the 100 single-digit sums, 80 trained on,
20 held out) asked in its own words and its own chat template, with no warm start:
``What is 3 + 4? Answer with just the number.`` (``TEMPLATE``, the env's ``template``
option) under SmolLM2's ChatML and default system prompt. The reward,
``examples/rewards/smollm2.yaml``, is math-verify accuracy on the whole reply, which reads
``7``, ``The answer is 7.`` or ``3 + 4 = 7`` alike.

The server: SmolLM2 in float32 (the trainer's type, so the sampler's logprobs are the
trainer's to ~1e-4), a 512 MiB KV cache (~11,000 tokens: a step's 128 sequences fit at
once). The trainer leaves the embeddings and the output layer alone (``--freeze-embeddings``)
and checkpoints only at the end (a 135M model and its Adam state are ~1.3 GB a save).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollq.ops.local.smollm2 import MODEL_NAME

SMOLLM2_REWARD = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "smollm2.yaml"
TEMPLATE = "{problem} Answer with just the number."
"""The ``sums`` env's prompt template for SmolLM2 (the user message)."""
ENV = "sums"
SERVER: dict[str, Any] = {"served_name": MODEL_NAME, "kv_cache_bytes": 512 * 1024 * 1024,
                          "max_model_len": 1024}
"""``VllmProcess`` options for SmolLM2 (module docstring)."""


def env_options() -> list[str]:
    """The workers' and the feeder's ``--env-option`` flags."""
    return ["--env-option", f"template={TEMPLATE}"]


def prompt_style() -> Any:
    """The ``PromptStyle`` the workers build from ``env_options`` (for the evaluations)."""
    from rollq.producers.envs.dataset import PromptStyle

    return PromptStyle(template=TEMPLATE)


DEFAULTS: dict[str, Any] = {
    "steps": 60, "batch_groups": 16, "group_size": 8, "max_tokens": 16, "lr": 1e-5,
    "kl_coef": 0.0, "torch_threads": 1, "eval_every": 10, "freeze_embeddings": True,
    "checkpoint_every": 1000, "weight_sync": "transfer",
}
"""``rollq demo --task smollm2``'s recipe (``DemoOptions``), measured on 2 CPU cores."""
