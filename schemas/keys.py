"""Redis key layout.

Every key of a run partition shares one hash tag, ``{<run>:<p>}``, so a Lua script may
touch the partition's traj, scored and dead streams atomically even on a Redis Cluster.
Run-wide state (policy version, admission counters, the partition count) lives under the
tag ``{<run>}``.

    rollq:{<run>:<p>}:traj      raw trajectory groups (producers XADD)
    rollq:{<run>:<p>}:scored    scored groups (the scorer's forward script XADDs)
    rollq:{<run>:<p>}:dead      dead letters of either stage
    rollq:{<run>:<p>}:counters  hash: scored, consumed, drop:<reason>… (updated in the same
                                Lua call as the XACK they describe, so counts are exact)
    rollq:{<run>:<p>}:readmit   list: ids of requeued rollout jobs waiting for the feeder
    rollq:{<run>:<p>}:sessions  sorted set: open external session groups by last activity
    rollq:{<run>:<p>}:session:<group_id>:<part>
                                one open session group (``producers.sessions.store``): its
                                hash, each session's captured calls, idempotency claims
    rollq:{<run>}:state         hash: partitions, policy_version, created_at, counters
    rollq:runs                  set of known run names
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from typing import Literal

from rollq.schemas.errors import ConfigError

StreamName = Literal["traj", "scored", "dead"]
STREAM_NAMES: tuple[StreamName, ...] = ("traj", "scored", "dead")
PREFIX = "rollq"
RUNS_KEY = f"{PREFIX}:runs"

# Run names end up inside hash tags and key names: braces or colons would break the tag.
_RUN_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# Fields of the run state hash.
PARTITIONS_FIELD = "partitions"
POLICY_VERSION_FIELD = "policy_version"
ADMITTED_FIELD = "admitted"  # groups the feeder enqueued, ever
TRAINER_WAITING_FIELD = "trainer_waiting_groups"
"""Groups the run's trainer has waited for longer than ``wait_log_s`` (absent: no trainer
waits); ``consumers.trainer.waiting`` writes it."""
FEED_BATCH_GROUPS_FIELD = "feed_batch_groups"  # the running feeder's batch_groups
FEED_MAX_STALENESS_FIELD = "feed_max_staleness"  # and its max_staleness (its budget's terms)

# Fields of the per-partition counters hash.
SCORED_COUNTER = "scored"  # groups the scorers forwarded
CONSUMED_COUNTER = "consumed"  # groups a trainer acked after a step
DROP_PREFIX = "drop:"  # drop:<reason>: groups removed before training, by reason


def check_run_name(run: str) -> str:
    """Return ``run`` unchanged, or raise ``ConfigError`` (a ValueError) saying which
    characters are allowed."""
    if not _RUN_NAME.match(run):
        raise ConfigError(
            f"run name {run!r} is invalid: use 1-64 characters from A-Z a-z 0-9 _ . -"
        )
    return run


def stream_key(run: str, partition: int, name: StreamName) -> str:
    """Key of one stream of one partition, e.g. ``rollq:{gsm8k:0}:traj``."""
    return f"{PREFIX}:{{{run}:{partition}}}:{name}"


def stream_keys(run: str, partitions: int, name: StreamName) -> list[str]:
    """Keys of ``name`` for every partition of a run, in partition order."""
    return [stream_key(run, p, name) for p in range(partitions)]


def state_key(run: str) -> str:
    """Key of the run's state hash (partitions, policy version, admission counters)."""
    return f"{PREFIX}:{{{run}}}:state"


def counters_key(run: str, partition: int) -> str:
    """Key of a partition's counters hash (same hash tag as its streams)."""
    return f"{PREFIX}:{{{run}:{partition}}}:counters"


def sessions_key(run: str, partition: int) -> str:
    """Key of a partition's index of open external session groups (same hash tag as its
    streams, so closing a group and XADDing it is one script)."""
    return f"{PREFIX}:{{{run}:{partition}}}:sessions"


def session_key(run: str, partition: int, group_id: str, part: str) -> str:
    """Key ``part`` of one open session group, e.g. ``rollq:{tools:0}:session:<id>:group``."""
    return f"{PREFIX}:{{{run}:{partition}}}:session:{group_id}:{part}"


def sum_counters(hashes: Iterable[Mapping[bytes, bytes]]) -> dict[str, int]:
    """The run's counters: the partitions' counters hashes (as HGETALL returns them) summed
    field by field."""
    counters: dict[str, int] = {}
    for fields in hashes:
        for name, value in fields.items():
            counters[name.decode()] = counters.get(name.decode(), 0) + int(value)
    return counters


def readmit_key(run: str, partition: int) -> str:
    """Key of a partition's list of requeued rollout jobs that wait for admission (same
    hash tag as its dead stream, so a requeue moves a letter there in one script)."""
    return f"{PREFIX}:{{{run}:{partition}}}:readmit"


def run_key(run: str, name: str) -> str:
    """Key of another run-wide value, e.g. the feeder cursor or the seen-set of a trainer."""
    return f"{PREFIX}:{{{run}}}:{name}"


def partition_of(group_id: str, partitions: int) -> int:
    """The partition a group goes to: a stable hash of its id, so a re-run lands beside it."""
    return zlib.crc32(group_id.encode()) % partitions


def partner_key(key: str, name: str) -> str:
    """The key ``name`` (a stream or ``counters``) in the same partition as stream ``key``."""
    head, _, _ = key.rpartition(":")
    return f"{head}:{name}"


# -- rollout jobs (arq's queue) ---------------------------------------------------------

def queue_name(run: str) -> str:
    """The arq queue of a run's rollout jobs."""
    return run_key(run, "jobs")


def job_id(run: str, env: str, position: int) -> str:
    """``<run>:<env>:<position>``: the job id, the group id it publishes, and the
    ``source_id`` of its dead letter (``rollq dead requeue`` splits it from the right)."""
    return f"{run}:{env}:{position}"


def parse_job_id(run: str, ident: str) -> tuple[str, int] | None:
    """``(env, position)`` of job id ``<run>:<env>:<position>`` (an env name may hold
    colons); None when ``ident`` is not a job id of ``run``."""
    if not ident.startswith(run + ":"):
        return None
    env, _, position = ident[len(run) + 1:].rpartition(":")
    if not env or not position.isdigit():
        return None
    return env, int(position)


HEALTH_KEY = "workers:health:"
"""``run_key(run, HEALTH_KEY + name)``: arq's health record of one worker process,
``… j_complete=N j_failed=N j_retried=N j_ongoing=N queued=N``, refreshed every
``HEALTH_INTERVAL_S`` and expiring a second later (``producers.worker`` writes them,
``ops.health`` reads them)."""
WAITING_KEY = "workers:waiting:"
"""``run_key(run, WAITING_KEY + name)``: a worker process that waits for its inference servers
before it takes a job (no arq health record yet); refreshed every ``HEALTH_INTERVAL_S``,
expiring a second later (``ops.health``)."""
HEALTH_INTERVAL_S = 10


def adapter_name(prefix: str, version: int) -> str:
    """The LoRA adapter name policy version ``version`` is served under with
    ``weight_sync='lora'``: ``<prefix>-v<version>`` (the trainer loads it, workers name it)."""
    return f"{prefix}-v{version}"


def adapter_version(prefix: str, name: str) -> int | None:
    """The version an adapter name of ``prefix`` carries (None: not one of ours)."""
    found = re.fullmatch(re.escape(prefix) + r"-v([0-9]+)", name)
    return int(found.group(1)) if found else None
