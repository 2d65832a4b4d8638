"""Async client of vLLM's OpenAI-compatible API: one server (``InferenceServer``) and a
balanced, health-checked, pause-aware pool of them (``InferencePool``).

Token ids and logprobs always come from the server (``return_token_ids``, ``logprobs``);
nothing is re-tokenised or recomputed client side.
"""

from rollq.producers.inference.errors import (
    GenerationAborted,
    InferenceRequestError,
    InferenceResponseError,
    PauseTimeout,
    PromptTooLongError,
    ServerUnreachable,
)
from rollq.producers.inference.params import Backoff, Choice, ModelInfo, SamplingParams
from rollq.producers.inference.pool import InferencePool
from rollq.producers.inference.server import InferenceServer, MessageDict

__all__ = [
    "Backoff",
    "Choice",
    "GenerationAborted",
    "InferencePool",
    "InferenceRequestError",
    "InferenceResponseError",
    "InferenceServer",
    "MessageDict",
    "ModelInfo",
    "PauseTimeout",
    "PromptTooLongError",
    "SamplingParams",
    "ServerUnreachable",
]
