"""The capture layer: every model call of an episode, recorded with the server's own tokens.

One layer serves the episode API (``EpisodeClient``), the capturing OpenAI gateway
(``CaptureHub``, served over HTTP by ``ops.gateway`` or in-process by ``LocalGateway``)
and any token-exact route an adapter needs (e.g. an Atropos env's server calls).

The whole API:

- ``Upstream(pool)``: the vLLM servers, shared by every episode.
- ``EpisodeCapture(upstream, episode_id=, defaults=, policy_version=)``: one episode;
  ``await capture.chat(body)`` / ``await capture.complete(body)`` take an OpenAI request
  body and return the reply body; ``capture.close()`` returns the ``CapturedEpisode``.
- ``EpisodeClient(capture)``: ``client.chat.completions.create(...)`` and
  ``client.completions.create(...)`` returning OpenAI-shaped objects.
- ``CaptureHub`` / ``LocalGateway`` / ``RemoteGateway``: episodes behind a base URL of their
  own (``…/episodes/<id>/v1``).
- ``CapturedEpisode``: ``sequences`` (``CapturedSequence``: prompt ids, then model tokens
  with loss mask 1 and the server's logprobs and env tokens with mask 0 and logprob 0,
  per-token versions, the calls merged) and ``stats`` (``CaptureStats``: calls, token-in
  calls, text-drift count). How calls merge: ``capture.record``; when a call is sent as
  token ids: ``capture.session``.
"""

from rollq.producers.inference.capture.client import EpisodeClient
from rollq.producers.inference.capture.gateways import (
    CaptureTransport,
    EpisodeGateway,
    LocalGateway,
    OpenEpisode,
    RemoteGateway,
)
from rollq.producers.inference.capture.hub import CaptureHub, GatewayReply, UnknownEpisode
from rollq.producers.inference.capture.record import (
    CapturedCall,
    CapturedEpisode,
    CapturedSequence,
    CaptureStats,
    assemble_sequences,
)
from rollq.producers.inference.capture.session import EpisodeCapture, EpisodeClosed
from rollq.producers.inference.capture.upstream import Upstream

__all__ = [
    "CaptureHub",
    "CaptureStats",
    "CaptureTransport",
    "CapturedCall",
    "CapturedEpisode",
    "CapturedSequence",
    "EpisodeCapture",
    "EpisodeClient",
    "EpisodeClosed",
    "EpisodeGateway",
    "GatewayReply",
    "LocalGateway",
    "OpenEpisode",
    "RemoteGateway",
    "UnknownEpisode",
    "Upstream",
    "assemble_sequences",
]
