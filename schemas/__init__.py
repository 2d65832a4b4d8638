"""rollq's wire contract: models, the codec, key layout and the error tree.

This package is the leaf of the import graph: it imports nothing else of rollq's, so a
trainer can depend on it alone.
"""

from rollq.schemas.arrays import broadcast, is_broadcast
from rollq.schemas.codec import (
    Fields,
    decode,
    decode_dead,
    decode_scored,
    decode_trajectory,
    encode,
    encode_dead,
    encode_scores,
    join_trajectory,
    scored_rewards,
    trajectory_ref,
)
from rollq.schemas.errors import (
    BrokerUnavailable,
    ConfigError,
    ContractError,
    DecodeError,
    InferenceUnavailable,
    RewardError,
    RollqError,
    TransientError,
    UnknownVersionError,
)
from rollq.schemas.models import (
    SCHEMA_VERSION,
    Completion,
    DeadLetter,
    SamplingRecord,
    ScoredGroup,
    SequenceScore,
    StreamGroup,
    TrajectoryGroup,
)

__all__ = [
    "SCHEMA_VERSION",
    "BrokerUnavailable",
    "Completion",
    "ConfigError",
    "ContractError",
    "DeadLetter",
    "DecodeError",
    "Fields",
    "InferenceUnavailable",
    "RewardError",
    "RollqError",
    "SamplingRecord",
    "ScoredGroup",
    "SequenceScore",
    "StreamGroup",
    "TrajectoryGroup",
    "TransientError",
    "UnknownVersionError",
    "broadcast",
    "decode",
    "decode_dead",
    "decode_scored",
    "decode_trajectory",
    "encode",
    "encode_dead",
    "encode_scores",
    "is_broadcast",
    "join_trajectory",
    "scored_rewards",
    "trajectory_ref",
]
