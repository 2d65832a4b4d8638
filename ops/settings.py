"""Settings: one frozen model per role, read once at start-up and passed down explicitly.

Precedence, highest first: command-line flags, ``ROLLQ_<FIELD>`` environment variables, the
config file (YAML; top-level keys shared by every role, plus one section per role), the
model's defaults.

A setting is declared once, as a field with a docstring: its flag (``flag_name``), its
environment variable (``env_name``), its YAML key (the field's name) and its line in
``docs/reference/settings.md`` are all derived from the field (``ops.cli.common`` builds
the flags, ``ops.docs_settings`` the page). Library code never reads ``os.environ``: only
``load_settings`` does, and only when the CLI hands it the environment.

A config file may look like::

    redis_url: redis://127.0.0.1:6379/0
    run: gsm8k-qwen
    scorer:
      reward_config: reward.yaml
      concurrency: 16
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_origin
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from rollq.consumers.bus import ReaderSettings
from rollq.ops.setting_fields import env_name, flag_name, value_type
from rollq.schemas import ConfigError
from rollq.schemas.keys import check_run_name

S = TypeVar("S", bound="CommonSettings")


class CommonSettings(BaseModel):
    """Settings every role shares."""

    # use_attribute_docstrings: each field's docstring is its description, the help of its flag
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
    section: str = Field(default="", exclude=True, repr=False)

    redis_url: str = "redis://127.0.0.1:6379/0"
    """The data plane: one Redis server (``redis://host:port/db``, ``rediss://`` for TLS) or
    any node of a Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://``)."""
    queue_url: str | None = None
    """The control plane (arq's job queue): one Redis server; default ``redis_url``, which
    must then not be a cluster."""
    wait_replicas: int = Field(default=0, ge=0)
    """On a cluster: replicas that must acknowledge every write (``WAIT``) before it counts
    as done, so a failover cannot lose it; 0: asynchronous replication."""
    wait_timeout_ms: int = Field(default=1000, ge=1)
    """How long a write waits for ``wait_replicas`` (milliseconds) before it is retried."""
    run: str = "default"
    """The run: a namespace for streams, counters and the policy version."""
    partitions: int = Field(default=1, ge=1, le=1024)
    """Stream partitions for a new run (a run keeps the count it was created with)."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """``auto``: console in a terminal, JSON otherwise."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lines below this level are not written (rollq's own and its libraries')."""
    redis_ca_file: Path | None = None
    """With ``rediss://``: the CA bundle that signed the server's certificate."""
    redis_cert_file: Path | None = None
    """With ``rediss://``: a client certificate, for servers that require one."""
    redis_key_file: Path | None = None
    """With ``rediss://``: the client certificate's private key."""
    redis_tls_verify: bool = True
    """With ``rediss://``: verify the server's certificate (turn off only for tests)."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve Prometheus ``/metrics`` on this port (0: any free port, logged); None: off.
    Needs the ``metrics`` extra."""
    redis_give_up_s: float = Field(default=300.0, ge=0)
    """How long a running role rides out a Redis outage (seconds of continuous failure)
    before it exits with 69; at start-up Redis must answer at once."""
    stall_warning_s: float = Field(default=300.0, gt=0)
    """A long-running role whose run makes no progress (nothing scored or consumed) for this
    long logs one WARNING saying why (``ops.watchdog``)."""

    @field_validator("run")
    @classmethod
    def _valid_run(cls, value: str) -> str:
        return check_run_name(value)

    @field_validator("redis_url", "queue_url")
    @classmethod
    def _valid_redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme = urlsplit(value).scheme
        if scheme not in REDIS_SCHEMES:
            raise ValueError(f"{redact_url(value)!r} is not a Redis URL: it must start with "
                             f"{' or '.join(s + '://' for s in REDIS_SCHEMES)} "
                             "(e.g. redis://127.0.0.1:6379/0)")
        return value


REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def check_inference_urls(urls: list[str]) -> list[str]:
    """ValueError unless every URL is an http(s) base URL with a host."""
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{redact_url(url)!r} is not an inference server's base URL: it "
                             "must be http://HOST:PORT or https://... (e.g. "
                             "http://127.0.0.1:8000)")
    return urls


InferenceUrls = Annotated[list[str], AfterValidator(check_inference_urls)]
"""vLLM base URLs, checked when the settings are built, not at the first request."""


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class ReaderTuning(CommonSettings):
    """Settings of roles that read a stream in a consumer group."""

    consumer: str = ""
    """Consumer name within the group; default: host name and process id."""
    block_ms: int = Field(default=2000, ge=0)
    """How long one read waits for new entries, in milliseconds."""
    reclaim_idle_s: float = Field(default=60.0, gt=0)
    """Entries pending longer than this (seconds) are taken over from a dead consumer."""
    max_deliveries: int = Field(default=5, ge=1)
    """Deliveries after which an entry is dead-lettered."""
    retention_s: float = Field(default=3600.0, ge=0)
    """Keep acknowledged entries this long (seconds) before trimming them: raw groups for
    ``rollq rescore``, scored groups for a trainer resuming from a checkpoint (keep it above
    the checkpoint interval). Unacknowledged entries are never trimmed."""
    dead_retention_s: float = Field(default=7 * 86400.0, ge=0)
    """Keep dead letters this long (seconds) for inspection and ``rollq dead requeue``;
    their ``drop:<reason>`` counts stay."""
    consumer_idle_s: float = Field(default=3600.0, gt=0)
    """A consumer idle this long (seconds) with nothing pending is removed from its group
    (restarted roles under the default host-pid name leave one behind each time)."""

    def reader_settings(self, count: int) -> ReaderSettings:
        """The reader these settings configure, taking up to ``count`` entries a read: the
        one reader-settings type, built here from the config (which speaks seconds)."""
        return ReaderSettings(block_ms=self.block_ms, count=count,
                              reclaim_idle_ms=int(self.reclaim_idle_s * 1000),
                              max_deliveries=self.max_deliveries)


class ScorerSettings(ReaderTuning):
    section: str = Field(default="scorer", exclude=True, repr=False)
    reward_config: Path | None = None
    """YAML reward configuration; default: the ``r1``-style accuracy + format bridge."""
    concurrency: int = Field(default=16, ge=1)
    """Groups scored at once by one scorer process."""
    processes: int = Field(default=2, ge=1)
    """Worker processes for CPU-heavy reward components (math-verify)."""
    zero_variance_breaker: int = Field(default=16, ge=0)
    """Consecutive groups dropped as zero-variance (every completion of a group got the same
    reward: no signal for GRPO) after which the scorer stops the run's admission through
    its circuit breaker until ``rollq runs resume``; 0: never stop."""
    trim_every_s: float = Field(default=30.0, gt=0)
    """Seconds between the scorer's housekeeping rounds: trimming what every consumer group
    acked (older than ``retention_s``), dead letters past ``dead_retention_s`` and idle
    consumers."""


class WorkerSettings(CommonSettings):
    section: str = Field(default="workers", exclude=True, repr=False)
    env: str = "gsm8k"
    """The env: ``gsm8k``, ``math``, ``guess``, ``sums``, ``tools``; another ecosystem's
    (its extra installed) as ``gem:ENV_ID``, ``skyrl:ENV_ID``, ``areal:MODULE:ATTRIBUTE``,
    ``atropos:MODULE:ENVCLASS``, ``reasoning_gym:TASK[+TASK...]`` or ``openenv:URL``
    (``openenv:MODULE[:APP]``: a server the workers start); or your own as
    ``module:attribute``."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env (e.g. ``source``, a dataset file)."""
    inference: InferenceUrls = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vLLM base URLs (comma-separated in the environment)."""
    model: str = ""
    """Model name the servers serve; empty: asked from ``/v1/models``."""
    group_size: int = Field(default=8, ge=1)
    """Completions per prompt: one GRPO group (``n`` of the generation request)."""
    concurrency: int = Field(default=8, ge=1)
    """Rollout jobs one worker process runs at once (arq ``max_jobs``)."""
    max_tokens: int = Field(default=256, ge=1)
    """Most tokens generated per completion (per model turn in multi-turn envs); an agent's
    own ``max_completion_tokens``/``max_tokens`` wins for its calls."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 1.0 samples the policy itself, as on-policy RL wants."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus mass; 1.0 keeps every token."""
    sampling_options: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of every generation request (vLLM's OpenAI API names, e.g. ``min_p``,
    ``repetition_penalty``, ``structured_outputs``); ``top_k``, ``seed`` and ``stop`` set
    those sampling fields. Fields rollq sets itself (``SAMPLING_OWNED``) are refused."""
    job_timeout_s: float = Field(default=600.0, gt=0)
    """A job running longer is cancelled and retried (arq ``job_timeout``)."""
    max_tries: int = Field(default=5, ge=1)
    """Tries of a rollout job before it is dead-lettered (retryable failures only; see the
    failures reference)."""
    request_timeout_s: float = Field(default=300.0, gt=0)
    """Longest wait for one generation request (seconds) before it counts as failed."""
    grace_s: int = Field(default=25, ge=0)
    """On SIGINT/SIGTERM, jobs in hand get this long to finish (seconds) before they are
    cancelled back into the queue; below Kubernetes' default 30 s stop window."""
    job_result_ttl_s: float = Field(default=600.0, gt=0)
    """How long a finished job's id (and arq's result) is kept (seconds); a re-enqueue of
    the same position within it is refused."""
    max_entry_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Largest encoded group a worker publishes (bytes: token arrays ~9 B per token, plus
    text and metadata; 64 MiB holds 16 x 256k tokens); a larger one is dead-lettered as
    ``entry_too_large`` instead of filling Redis' memory."""
    logprobs_mode: Literal["auto", "raw_logprobs", "processed_logprobs", "raw_logits",
                           "processed_logits"] = "auto"
    """The servers' vLLM ``--logprobs-mode``, recorded with every completion. ``auto``: each
    server says it (``GET /server_info``, once; vLLM answers only with
    ``VLLM_SERVER_DEV_MODE=1``, else it is recorded as not known and a trainer's off-policy
    correction refuses the group). Set it when the servers run without dev mode."""
    lora_name: str = ""
    """With a trainer on ``weight_sync='lora'``: its ``lora_name``. Each generation names the
    adapter of the run's version, ``<lora_name>-v<version>`` (the base model at version 0),
    and its tokens carry that version exactly. Empty: the model."""


    @field_validator("sampling_options")
    @classmethod
    def _own_fields_kept(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(value) & set(SAMPLING_OWNED))
        if owned:
            raise ValueError("; ".join(f"{key}: {SAMPLING_OWNED[key]}" for key in owned))
        for key in ("top_k", "seed"):
            if key in value and (isinstance(value[key], bool) or
                                 not isinstance(value[key], int)):
                raise ValueError(f"{key} must be an integer (got {value[key]!r})")
        stop = value.get("stop", [])
        if not (isinstance(stop, str) or (isinstance(stop, list) and
                                          all(isinstance(item, str) for item in stop))):
            raise ValueError(f"stop must be a string or a list of strings (got {stop!r})")
        return value


SAMPLING_OWNED = {
    **dict.fromkeys(("model", "prompt", "messages", "n", "logprobs", "top_logprobs",
                     "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
                     "stream", "stream_options", "echo"),
                    "rollq sets it on every request (ids and logprobs are always asked)"),
    "max_tokens": "use max_tokens (--max-tokens); the multi-turn bridge sets it per turn",
    "max_completion_tokens": "use max_tokens (--max-tokens)",
    "temperature": "use temperature (--temperature)",
    "top_p": "use top_p",
}
"""Request fields a ``--sampling-option`` may not set, with what to do instead."""


class FeederSettings(CommonSettings):
    section: str = Field(default="feeder", exclude=True, repr=False)
    env: str = "gsm8k"
    """The env whose items are fed, named as the workers' ``env`` (``gsm8k``, ``gem:ENV_ID``,
    ``atropos:MODULE:ENVCLASS``, ``reasoning_gym:TASK``, ``openenv:URL``,
    ``module:attribute``, ...): jobs name it, and workers of another env refuse them."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """The env's keyword arguments, as the workers' (the dataset and its size)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the dataset; the cursor lives in Redis."""
    max_staleness: int = Field(default=1, ge=0)
    """How many policy versions a group may lag the trainer (AReaL's eta)."""
    batch_groups: int = Field(default=8, ge=1)
    """Groups the trainer consumes per optimizer step."""
    poll_s: float = Field(default=0.2, gt=0)
    """How often the feeder re-checks its admission budget (seconds)."""
    shuffle_seed: int | None = None
    """Visit each epoch's items in a permutation drawn from this seed and the epoch
    (``producers.order``); None: dataset order."""
    breaker_failures: int = Field(default=10, ge=0)
    """Consecutive rollout jobs dead-lettered with the same contract or inference reason
    after which the feeder stops admitting until ``rollq runs resume`` (capped at the first
    admission budget, ``(max_staleness + 1) × batch_groups``); 0: never stop."""


RewardSource = Literal["env", "bridge"]
"""Where the Atropos API's posted groups get their rewards (``AtroposApiSettings.rewards``)."""


class AtroposApiSettings(CommonSettings):
    """The Atropos-compatible trajectory API of one run."""

    section: str = Field(default="atropos_api", exclude=True, repr=False)
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on (atroposlib's envs and trainers default to 8000)."""
    rewards: RewardSource = "env"
    """``env``: posted groups go straight to the scored stream, rewarded with the env's
    own scores. ``bridge``: they go to the traj stream and rollq's scorers (``rollq
    score``) reward them with the reward bridge; the env's score is the ``env_score``
    component."""
    consumer_group: str = Field(default="atropos", min_length=1)
    """Consumer group of ``/batch`` on the scored streams (every API process of a run
    shares it)."""
    gzip_level: int = Field(default=1, ge=1, le=9)
    """gzip level of large answers and of each group's ``/batch`` piece, deflated once when
    the group is posted (atroposlib uses 9 per answer; 1 is several times faster)."""
    piece_cache_mb: int = Field(default=512, ge=0)
    """Memory of this process for copies of the pieces it posted or read (a 16x2048-token
    group's piece is ~0.45 MB): a batch of them is joined without reading them back from
    Redis. 0: always read from Redis."""
    dedup_window_s: int = Field(default=600, ge=0)
    """An identical re-post (same env, tokens and scores) within this many seconds is
    answered ``received`` without storing the group again (atroposlib's env re-posts after
    a 5xx or a timeout). 0: off."""
    lock_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for, and hold of, the lock that serialises batch assembly."""
    outage_hold_s: float = Field(default=30.0, ge=0)
    """A request that finds Redis unreachable is run again (with back-off) for up to this
    many seconds before it is answered 503: atroposlib's env exits after a few seconds of
    errors, so a Redis restart must not reach it. 0: answer 503 at once."""
    delivery_wait_s: float = Field(default=5.0, ge=0)
    """How long ``/batch`` waits for the verdict on the previous batch's answer (sent in
    full or not) before handing that batch out again: the verdict is recorded just after
    the last byte is written, and is missing for good when the API that sent it died."""
    inference: InferenceUrls = Field(default_factory=list)
    """vLLM base URLs served to Atropos envs under ``/inference`` (atroposlib's ``vllm``
    server type: ``/generate`` with the server's token ids; ``ops.atropos.inference``).
    Empty: no inference routes."""
    model: str = ""
    """Served model name of ``inference``; empty: asked from ``/v1/models``."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one generation of the inference routes."""


class GatewaySettings(CommonSettings):
    """The capturing gateway in front of one model's vLLM servers (it uses Redis only with
    ``sessions``: ``redis_url``, ``run`` and ``partitions`` then say where)."""

    section: str = Field(default="gateway", exclude=True, repr=False)
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface)."""
    port: int = Field(default=8100, ge=0, le=65535)
    """Port to listen on."""
    inference: InferenceUrls = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vLLM base URLs (one model); balanced, health-checked, paused-aware like a worker's."""
    model: str | None = None
    """Served model name; None: asked from ``/v1/models``. Every request is sent with it."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one generation."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a failed upstream call before the agent gets a 503."""
    episode_ttl_s: float = Field(default=3600.0, gt=0)
    """An episode with no call and no close for this long is dropped (its worker died)."""
    tool_parser: str | None = "hermes"
    """How replies of token-in chat calls find tool calls: ``hermes`` or None."""
    tokenizer: str | None = None
    """The served model's tokenizer (a local directory or hub id): with ``transformers``
    installed, chat continuations are rendered in the gateway instead of by two
    ``/tokenize`` requests each (checked against the server first, ``capture.render``);
    None: always ``/tokenize``."""
    chat_template: str | None = None
    """The chat template the vLLM server was started with (``--chat-template``: a file or
    the template), used with ``tokenizer``; None: the tokenizer's own."""
    continuation_check: Literal["before", "after"] = "before"
    """When a chat continuation is checked for re-tokenisation: ``before`` renders the
    conversation through ``/tokenize`` first (two renders per continuation, about 3 ms each
    on an idle server; no generation is ever discarded); ``after`` sends it at once and
    checks the prompt ids the server reports (no extra request when the template reproduces
    the earlier tokens; on drift the generation is discarded and made again token-in, and
    the episode checks ``before`` from then on). ``after`` pays only where replies seldom
    re-tokenise differently: the CPU bench's random model drifts on every continuation."""
    sessions: bool = False
    """Serve external agent sessions (``POST /sessions``, ``producers.sessions``): episodes
    opened by agents outside rollq's workers, kept in the run's Redis, published onto its
    traj stream when closed."""
    session_ttl_s: float = Field(default=900.0, gt=0)
    """A session group with no call and no close for this long is dead-lettered
    ``session_expired``."""
    max_staleness: int = Field(default=1, ge=0)
    """Sessions' admission: how many policy versions a group may lag the trainer (the
    feeder's setting of the same name)."""
    batch_groups: int = Field(default=8, ge=1)
    """Sessions' admission: groups the trainer consumes per optimizer step."""
    retry_after_s: int = Field(default=5, ge=1)
    """``Retry-After`` of a session open refused for want of an admission slot (429)."""


def load_settings(
    cls: type[S],
    *,
    environ: Mapping[str, str],
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build ``cls`` from defaults < config file < ``ROLLQ_*`` variables < ``overrides``.

    Raises ``ConfigError`` naming the offending field and where its value came from.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    section = cls.model_fields["section"].default
    if config_file is not None:
        document = _read_config(config_file)
        role = document.pop(section, None) or {}
        for other in roles():
            document.pop(other, None)
        known = set().union(*(model.model_fields for model in roles().values()))
        for name, value in document.items():
            if name not in known:
                raise ConfigError(f"{config_file}: unknown setting {name!r}")
            if name in cls.model_fields:
                values[name], sources[name] = value, str(config_file)
        for name, value in role.items():  # a role's own section: unknown names are errors
            values[name], sources[name] = value, f"{config_file} [{section}]"
    for name, field in cls.model_fields.items():
        raw = environ.get(env_name(name))
        if raw is not None and name != "section":
            kind = get_origin(value_type(field))
            values[name] = raw.split(",") if kind is list else raw
            if kind is dict:
                values[name] = yaml.safe_load(raw)
            sources[name] = env_name(name)
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
            declared = cls.model_fields.get(name)
            sources[name] = (flag_name(name, declared) if declared else
                             "--" + name.replace("_", "-"))
    try:
        return cls(**values)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            origin = sources.get(str(error["loc"][0]), "default") if error["loc"] else "?"
            problems.append(f"{where} (from {origin}): {error['msg']}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None


def roles() -> dict[str, type[CommonSettings]]:
    """Every role's settings by config-file section name."""
    return {
        "scorer": ScorerSettings,
        "workers": WorkerSettings,
        "feeder": FeederSettings,
        "atropos_api": AtroposApiSettings,
        "gateway": GatewaySettings,
    }


def _read_config(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"config file {path} must be a mapping of setting names to values")
    return document
