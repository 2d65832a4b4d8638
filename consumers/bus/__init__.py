"""The consumer-group bus: the one owner of XREADGROUP, XACK, XAUTOCLAIM, XPENDING,
dead-lettering, the exactly-once forward and safe trimming. One concern a module:

- ``entries``: a delivered entry, entry ids, connection errors as ``BrokerUnavailable``;
- ``reader``: ``StreamReader`` — reads, own pending, reclaim, delivery counts, screening;
- ``settle``: ack, the exactly-once forward, drop and dead letter (``EntrySettler``);
- ``join``: scored entries joined with the trajectories they name;
- ``trimming``: trims that keep what any consumer group still needs;
- ``plain``: reads and appends outside consumer groups, and stream statistics.

Redis errors are translated in these modules: connection problems become
``BrokerUnavailable``; the BUSYGROUP/NOGROUP replies are matched in ``reader`` only.
"""

from rollq.consumers.bus.entries import (
    Delivery,
    is_cluster,
    is_entry_id,
    run_of_stream,
    translated_errors,
)
from rollq.consumers.bus.join import join_trajectories
from rollq.consumers.bus.plain import (
    GroupStats,
    StreamStats,
    append_entries,
    follow,
    read_range,
    stream_stats,
)
from rollq.consumers.bus.reader import ReaderSettings, StreamReader
from rollq.consumers.bus.settle import EntrySettler
from rollq.consumers.bus.trimming import trim_streams

__all__ = [
    "Delivery",
    "EntrySettler",
    "GroupStats",
    "ReaderSettings",
    "StreamReader",
    "StreamStats",
    "append_entries",
    "follow",
    "is_cluster",
    "is_entry_id",
    "join_trajectories",
    "read_range",
    "run_of_stream",
    "stream_stats",
    "translated_errors",
    "trim_streams",
]
