"""The ``smollm2`` task of the demo: a real pretrained model learns through rollq.

SmolLM2-135M-Instruct (``ops.local.smollm2``: fetched from PyPI, converted once) answers
rollq's ``sums`` problems (``producers.envs.sums``: the 100 single-digit sums, 80 trained
on, 20 held out) as the env asks them, ``What is 3 + 4?``, under SmolLM2's own ChatML
template and default system prompt, with no warm start. The reward,
``examples/rewards/smollm2.yaml``, is math-verify accuracy on the whole reply, plain
answers read too: ``7``, ``The answer is 7.`` or ``3 + 4 = 7`` alike.

Chosen by measurement (greedy, 16 new tokens, all 100 problems): 0.38 of the plain
questions are answered right at the start (``The answer to this classic math problem is
0.`` for 0 + 3; ``2 + 6 = 10``), 0.30 of the samples at temperature 1; with ``Answer with
just the number.`` appended, 0.67 and 0.35 (little room above); two-digit + one-digit sums
0.09 and 0.10, single-digit products 0.39 and 0.12.

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
ENV = "sums"
SERVER: dict[str, Any] = {"served_name": MODEL_NAME, "kv_cache_bytes": 512 * 1024 * 1024,
                          "max_model_len": 1024}
"""``VllmProcess`` options for SmolLM2 (module docstring)."""




DEFAULTS: dict[str, Any] = {
    "steps": 40, "batch_groups": 8, "group_size": 8, "max_tokens": 16, "lr": 5e-5,
    "kl_coef": 0.0, "torch_threads": 1, "eval_every": 10, "freeze_embeddings": True,
    "train_layers": 6, "checkpoint_every": 1000, "weight_sync": "transfer",
}
"""``rollq demo --task smollm2``'s recipe (``DemoOptions``), measured on 2 CPU cores."""
