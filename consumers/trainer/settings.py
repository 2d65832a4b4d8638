"""Settings of one trainer client: a frozen dataclass the training script constructs (the
trainer is the user's process, not a rollq role: it has no config-file section)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rollq.consumers.bus import ReaderSettings
from rollq.schemas.tls import RedisTls

PauseMode = Literal["keep", "wait", "abort"]
WeightSyncMethod = Literal["reload", "transfer", "external", "lora"]


@dataclass(frozen=True)
class TrainerClientSettings:
    """How a trainer reads scored groups and publishes weights. Every field has a default."""

    batch_groups: int = 8
    """Groups per batch when ``next_batch`` is called without a size."""
    max_staleness: int | None = 1
    """Groups whose ``policy_version`` is below ``current - max_staleness`` are dropped as
    ``drop:stale`` at consume time; None disables the check."""
    inference_urls: tuple[str, ...] = ()
    """vLLM base URLs (``http://host:port``) that ``publish_policy`` updates."""
    pause_mode: PauseMode = "keep"
    """How vLLM pauses for a reload: ``keep`` freezes in-flight requests and finishes them
    with the new weights, ``wait`` lets them finish first, ``abort`` truncates them."""
    weight_sync: WeightSyncMethod = "reload"
    """How ``publish_policy(step, weights)`` moves weights to the servers
    (docs/guides/weight-sync.md): ``reload`` — ``weights`` is a directory every server
    can read, each reloads it from disk; ``transfer`` — ``weights`` is the model (or its
    ``(name, tensor)`` pairs), sent through vLLM's weight-transfer API on
    ``transfer_backend``; ``external`` — the trainer moves the weights itself, ``weights``
    is the callable that does it while the servers are paused (or None); ``lora`` — the
    trainer trains a LoRA adapter, ``weights`` is its PEFT directory (one every server can
    read) or a ``LoraAdapter`` (written under ``lora_dir``), loaded by every server at run
    time as ``<lora_name>-v<step>``: nothing pauses (``consumers.trainer.lora``)."""
    lora_name: str = "policy"
    """``lora``: the adapters' name prefix; the workers' ``lora_name`` must be the same."""
    lora_dir: str | None = None
    """``lora``: where a ``LoraAdapter`` is written, one directory per version (one every
    server can read: a shared or local disk); versions unloaded are deleted from it."""
    transfer_backend: str = "nccl"
    """vLLM weight-transfer backend for ``transfer``; the servers must run with the same
    ``--weight-transfer-config '{"backend": ...}'``: ``nccl`` (GPUs; vllm installed in the
    trainer's environment), ``ipc`` (colocated on one GPU; likewise), ``rollq_tcp`` (CPU
    servers, rollq's plugin ``ops/vllm_plugin``)."""
    transfer_host: str = "127.0.0.1"
    """Address of the trainer that the servers' workers connect to for ``transfer``
    (NCCL's rendezvous, rollq_tcp's stream): an address every server can reach."""
    transfer_port: int = 0
    """Port for that (0: a free one, chosen at each engine set-up)."""
    transfer_chunk_bytes: int = 256 * 1024 * 1024
    """Most weight bytes per ``/update_weights`` call (rollq_tcp): the trainer's CPU copies
    of GPU tensors are bounded by this, never a second full copy of the model."""
    transfer_workers_per_server: int = 1
    """vLLM workers per server (tensor x pipeline parallel size): NCCL's group is the
    trainer plus every worker of every server, each server's ranks after the previous'."""
    http_timeout_s: float = 300.0
    """Timeout of each weight-sync HTTP call (seconds); ``wait`` pauses can take long."""
    block_ms: int = 1000
    """Longest single blocking read (milliseconds); ``next_batch`` loops until it has
    enough groups or its ``timeout_s`` passes."""
    read_count: int = 64
    """Most entries taken per read; a read for a batch sized by ``groups`` takes no more
    than the groups it still lacks."""
    reclaim_idle_ms: int = 600_000
    """Entries another trainer left pending this long (milliseconds) are taken over. Keep it
    well above the longest training step: a batch stays pending until ``ack``."""
    reclaim_every_s: float = 30.0
    """How often the client looks for abandoned entries (seconds)."""
    max_deliveries: int = 5
    """Deliveries after which an entry is dead-lettered (``max_deliveries``) instead of
    trained on: counted by Redis over reclaims and over this consumer's re-reads of its own
    pending entries after restarts, so an entry that crashes the trainer every time it is
    handed out stops coming back."""
    pad_token_id: int = 0
    """Token id written into padding positions of the padded layout."""
    vocab_size: int | None = None
    """The model's vocabulary size: a group holding a token id at or above it is
    dead-lettered (``decode_error``) instead of indexing past the embedding table. None:
    ids are only checked to be >= 0."""
    partitions: int = 1
    """Partition count to register when the run does not exist yet (the stored count wins)."""
    new_run: bool = False
    """This trainer starts a new run: publish weights to ``inference_urls`` even when no
    other role had registered the run. False: a run that did not exist when the client
    started (a typo in its name?) is warned about at once (``run_not_found_at_start``), and
    ``publish_policy`` sends nothing to the servers, which may serve another run, until
    some other role has worked on the run (admitted, published or scored a group)."""
    redis_give_up_s: float = 300.0
    """How long ``next_batch``, ``ack`` and ``publish_policy`` ride out a Redis outage
    (seconds of continuous failure) before they raise ``BrokerUnavailable``; 0 fails at
    once."""
    dedup_window_s: float = 6 * 3600.0
    """How long a trained group's id is remembered to drop copies of it (seconds); every
    copy that can still arrive does within it (see ``consumers.trainer.ledger``), so the
    seen-set holds one window of groups, not the whole run. Also bounds the trained log."""
    prefetch: bool = True
    """Prepare the next batch while the caller trains: once ``next_batch`` returns, a
    background task reads, checks, decodes and lays out the following batch of the same
    size, and the next call with that size hands it out without waiting for any of it.

    Costs: the memory of one more batch (its entries and padded arrays; never more than
    one), and its entries are delivered one step earlier: they are pending for this
    consumer while the current batch trains, so after a crash they come back with the
    unacked batch, and each restart counts one delivery of them too (``max_deliveries``).

    Guarantees: nothing is acked before its own ``ack``; staleness is judged when the batch
    is handed out (a prepared batch with a group that became stale is not handed out: the
    call drops that group as ``drop:stale`` and refills); a call with other sizes, or a
    closing client, leaves the prepared groups untouched, first in line, or pending; a
    poison entry or a Redis outage met while preparing ends as it would have in the next
    call (the same dead letter; an outage that lasts is ridden out by that call, with the
    same log lines), and any other error is raised by that call.

    False: every call does all its work while the caller waits."""
    wait_log_s: float = 30.0
    """While one ``next_batch`` waits longer than this (seconds), it logs
    ``trainer_waiting`` every ``wait_log_s`` (``consumers.trainer.waiting``)."""
    redis_ca_file: str | None = None
    """With a ``rediss://`` URL given to ``SyncTrainerClient``: the CA bundle that signed
    the server's certificate. None: ``ROLLQ_REDIS_CA_FILE`` (the variable the roles read),
    else the system's CAs."""
    redis_cert_file: str | None = None
    """With ``rediss://``: a client certificate, for servers that require one. None:
    ``ROLLQ_REDIS_CERT_FILE``."""
    redis_key_file: str | None = None
    """With ``rediss://``: the client certificate's private key. None:
    ``ROLLQ_REDIS_KEY_FILE``."""
    redis_tls_verify: bool | None = None
    """With ``rediss://``: verify the server's certificate (turn off only for tests). None:
    ``ROLLQ_REDIS_TLS_VERIFY``, else True."""
    log_max_len: int = 1_000_000
    """Entries kept in each consumer's trained log, one per acked batch (approximate cap).
    Must exceed the batches acked between two checkpoints, or resuming from the older one
    fails loudly."""

    def reader_settings(self) -> ReaderSettings:
        """The reader of the scored streams: the one reader-settings type, built here from
        this client's read fields (the trainer's defaults differ from a role's: a batch
        stays pending through the training step, so reclaim waits minutes)."""
        return ReaderSettings(block_ms=self.block_ms, count=self.read_count,
                              reclaim_idle_ms=self.reclaim_idle_ms,
                              reclaim_every_s=self.reclaim_every_s,
                              max_deliveries=self.max_deliveries)

    def redis_tls(self, environ: Mapping[str, str]) -> RedisTls:
        """The TLS options for a ``rediss://`` URL: these fields, else the ``ROLLQ_REDIS_*``
        variables of ``environ`` (the same ones, with the same meaning, as the roles')."""
        return RedisTls.from_environ(environ, ca_file=self.redis_ca_file,
                                     cert_file=self.redis_cert_file,
                                     key_file=self.redis_key_file, verify=self.redis_tls_verify)

    def __post_init__(self) -> None:
        positive = ("batch_groups", "read_count", "reclaim_idle_ms", "max_deliveries",
                    "partitions", "log_max_len", "transfer_chunk_bytes",
                    "transfer_workers_per_server")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.wait_log_s <= 0:
            raise ValueError(f"wait_log_s must be above 0, got {self.wait_log_s}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1 or None, got {self.vocab_size}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.weight_sync not in ("reload", "transfer", "external", "lora"):
            raise ValueError(f"weight_sync must be reload, transfer, external or lora, got "
                             f"{self.weight_sync!r}")
        if not self.lora_name or "/" in self.lora_name:
            raise ValueError(f"lora_name must be a non-empty name without '/', got "
                             f"{self.lora_name!r}")
        if not 0 <= self.transfer_port < 65536:
            raise ValueError(f"transfer_port must be in [0, 65535], got {self.transfer_port}")
        if self.dedup_window_s <= 0:
            raise ValueError(f"dedup_window_s must be > 0, got {self.dedup_window_s}")
        if self.block_ms < 0 or self.http_timeout_s <= 0 or self.reclaim_every_s < 0:
            raise ValueError("block_ms and reclaim_every_s must be >= 0, http_timeout_s > 0")
