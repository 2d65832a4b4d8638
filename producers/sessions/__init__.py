"""External agent sessions: episodes opened over HTTP on ``rollq gateway --sessions`` by
agents that run outside rollq's workers, kept in Redis (``SessionHost``, ``SessionStore``),
admitted under the run's staleness budget (``SessionGate``)."""

from producers.sessions.gate import AdmissionRefused, SessionGate
from producers.sessions.host import (
    CallInFlight,
    CloseOutcome,
    OpenedGroup,
    SessionClosed,
    SessionConflict,
    SessionCounts,
    SessionGone,
    SessionHost,
)
from producers.sessions.store import SessionStore

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
