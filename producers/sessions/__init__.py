"""External agent sessions: episodes opened over HTTP on ``rollq gateway --sessions`` by
agents that run outside rollq's workers, kept in Redis (``SessionHost``, ``SessionStore``),
admitted under the run's staleness budget (``SessionGate``)."""

from rollq.producers.sessions.gate import AdmissionRefused, SessionGate
from rollq.producers.sessions.host import (
    CallInFlight,
    CloseOutcome,
    OpenedGroup,
    SessionClosed,
    SessionConflict,
    SessionCounts,
    SessionGone,
    SessionHost,
)
from rollq.producers.sessions.store import SessionStore

__all__ = [
    "AdmissionRefused",
    "CallInFlight",
    "CloseOutcome",
    "OpenedGroup",
    "SessionClosed",
    "SessionConflict",
    "SessionCounts",
    "SessionGate",
    "SessionGone",
    "SessionHost",
    "SessionStore",
]
