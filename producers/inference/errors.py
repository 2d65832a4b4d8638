"""Inference errors, placed on rollq's one tree (``schemas.errors``).

- ``InferenceRequestError`` (a ``ContractError``): the server rejected the request (4xx:
  bad parameters, unknown model, prompt longer than the context). The same request cannot
  succeed on retry; the job's group is dead-lettered. ``PromptTooLongError`` narrows it
  for callers (the multi-turn bridge) that can end an episode instead.
- ``InferenceResponseError`` (a ``ContractError``): a 2xx body lacks what rollq needs
  (``token_ids``, per-token logprobs): the server is too old or misconfigured.
- ``InferenceUnavailable`` (a ``TransientError``) and its branches: the pool retried and
  gave up, or a single attempt failed in a way a retry may fix. ``ServerUnreachable``
  (connection-level) makes the pool mark the server unhealthy; ``GenerationAborted`` (the
  server was paused for a weight update mid-generation) and ``PauseTimeout`` are the
  pause cases.

httpx exceptions are translated in ``producers.inference.server`` and nowhere else.
"""

from __future__ import annotations

from rollq.schemas.errors import ContractError, InferenceUnavailable


class InferenceRequestError(ContractError):
    """The server rejected the request with a 4xx; retrying cannot help."""

    def __init__(self, message: str, *, status: int, param: str | None = None) -> None:
        super().__init__(f"inference request rejected ({status}): {message}")
        self.status = status
        """HTTP status code the server answered."""
        self.server_message = message
        """The server's own error message, verbatim."""
        self.param = param
        """The request parameter the server blamed (``input_tokens``, ``model``…), if any."""


class PromptTooLongError(InferenceRequestError):
    """The prompt alone exceeds the model's context length (``param == "input_tokens"``)."""


class InferenceResponseError(ContractError):
    """A successful response lacks fields rollq needs (token ids, logprobs)."""


class ServerUnreachable(InferenceUnavailable):
    """Connection-level failure (refused, reset, protocol error): the server looks down."""


class GenerationAborted(InferenceUnavailable):
    """The server aborted the generation (``finish_reason == "abort"``), as vLLM does for
    in-flight requests on ``/pause?mode=abort``. Retried after the pause ends."""


class PauseTimeout(InferenceUnavailable):
    """Every healthy server stayed paused for longer than the pool's ``pause_timeout_s``."""
