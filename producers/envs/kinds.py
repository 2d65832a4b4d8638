"""Built-in env kinds: other ecosystems' envs by name, ``--env KIND:SPEC``, no user code.

Each factory is called as ``factory(SPEC, **options)`` by ``make_env`` (``KINDS`` in
``producers.envs.registry``) and imports its package only then, so the core never needs
it; a missing package is a ``ConfigError`` naming the extra to install.

- ``gem:ENV_ID`` (extra ``gem``: gem-llm): ``gem.make(ENV_ID, **options)`` per episode,
  behind ``GemAdapter``, on the multi-turn bridge. Item ``i`` is ``reset(seed=first_seed +
  i)``; every episode of a group plays the same game. E.g. ``--env
  gem:game:GuessTheNumber-v0-easy``.
- ``skyrl:ENV_ID`` (extra ``skyrl``: skyrl-gym): a SkyRL-gym text env built per episode
  from its dataset row, ``skyrl_gym.make(ENV_ID, env_config=env_config, extras=row)``,
  started from the row's ``prompt`` (a chat), behind ``SkyRLGymAdapter``. The rows come
  from ``source`` (a SkyRL-format ``.parquet``/``.jsonl``: ``prompt``, ``reward_spec``,
  ``extra_info``...). E.g. ``--env skyrl:gsm8k --env-option source=train.parquet``.
- ``areal:MODULE:ATTRIBUTE``: an AReaL agent (AReaL itself is not needed by rollq): a
  workflow (``async run(data, base_url=, http_client=, api_key=)``), run on a gateway URL
  per episode, or an arealite ``RolloutCollector`` class (``arun_episode``), built per
  episode; items are the rows of ``source``. A class is called with the options left over.

Options every kind takes (the rest go to the package: ``gem.make``, the SkyRL env's
``env_config`` is the ``env_config`` option, the AReaL class's constructor):

- ``system_prompt``, ``max_episode_turns`` (the bridge's cap on model turns, default 100:
  these envs end their own episodes), ``max_completion_tokens``, ``truncated_turn`` and
  ``truncated_turn_penalty`` (``producers.envs.multiturn``): gem and SkyRL-gym;
- ``size`` (items, default 1000) and ``first_seed`` (default 0): gem;
- ``source``, ``split``, ``subset``, ``data_files`` (``load_records``): SkyRL-gym, AReaL;
- ``gateway``: AReaL workflows: the URL of a ``rollq gateway`` (default: one in-process);
  ``tokenizer`` and ``chat_template``: the in-process one renders chat continuations with
  the served model's tokenizer and the server's chat template (file) instead of
  ``/tokenize`` requests (``rollq gateway --tokenizer --chat-template``'s options).

The episode's return (sum of the env's turn rewards) is ``Completion.info["env_return"]``:
score it with the ``env_return`` reward component.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rollq.producers.envs.adapters import GemAdapter, SkyRLGymAdapter
from rollq.producers.envs.areal import ArealCollectorEnv, areal_workflow_env
from rollq.producers.envs.base import Env
from rollq.producers.envs.dataset import load_records
from rollq.producers.envs.multiturn import EpisodeEnv, EpisodeRunner, RecordEpisodeEnv
from rollq.producers.inference.capture import RemoteGateway
from rollq.producers.inference.capture.render import LocalTemplate
from rollq.schemas import ConfigError

DEFAULT_MAX_EPISODE_TURNS = 100
"""The bridge's cap on model turns for a kind's env, which ends its episodes itself."""

_RUNNER_OPTIONS = ("system_prompt", "max_completion_tokens", "truncated_turn",
                   "truncated_turn_penalty")
_DATASET_OPTIONS = ("split", "subset", "data_files")


def require(module: str, kind: str, extra: str) -> ModuleType:
    """Import an optional package for env kind ``kind``; a ``ConfigError`` naming the extra
    when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"env kind {kind!r} needs the {module!r} package: "
                          f"pip install 'rollq[{extra}]' ({exc})") from exc


def bridge_runner(options: dict[str, Any]) -> EpisodeRunner:
    """The multi-turn bridge's runner from a kind's options, taking the bridge's own
    (``system_prompt``, ``max_episode_turns``, ...) out of them."""
    fields = {key: options.pop(key) for key in _RUNNER_OPTIONS if key in options}
    return EpisodeRunner(max_turns=int(options.pop("max_episode_turns",
                                                   DEFAULT_MAX_EPISODE_TURNS)), **fields)


def _records(kind: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    source = options.pop("source", None)
    if source is None:
        raise ConfigError(f"env kind {kind!r} needs a 'source' option (a dataset file or name)")
    dataset = {key: options.pop(key) for key in _DATASET_OPTIONS if key in options}
    records = load_records(source, **dataset)
    if not records:
        raise ConfigError(f"env kind {kind!r}: dataset {source!r} has no rows")
    return records


def gem_env(spec: str, **options: Any) -> Env:
    """``gem:ENV_ID`` (module docstring)."""
    gem = require("gem", "gem", "gem")
    runner = bridge_runner(options)
    size, first_seed = int(options.pop("size", 1000)), int(options.pop("first_seed", 0))

    def make() -> GemAdapter:
        return GemAdapter(gem.make(spec, **options))

    try:
        make()  # an unknown id or a bad option fails here, at start-up, not in every job
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"gem.make({spec!r}, {options}): {exc}") from exc
    return EpisodeEnv(name=f"gem:{spec}", make_env=make, size=size, first_seed=first_seed,
                      runner=runner)


def skyrl_env(spec: str, **options: Any) -> Env:
    """``skyrl:ENV_ID`` (module docstring)."""
    skyrl_gym = require("skyrl_gym", "skyrl", "skyrl")
    runner = bridge_runner(options)
    records = _records("skyrl", options)
    env_config = options.pop("env_config", None)
    if options:
        raise ConfigError(f"env kind 'skyrl': unknown options {sorted(options)} (SkyRL-gym "
                          "settings go in the env_config option)")
    if spec not in skyrl_gym.registry:
        raise ConfigError(f"SkyRL-gym has no env {spec!r}; registered: "
                          f"{sorted(skyrl_gym.registry)}")
    for row in records:
        if not isinstance(row.get("prompt"), list):
            raise ConfigError(f"env kind 'skyrl': every row needs a 'prompt' chat (a list of "
                              f"messages); got {type(row.get('prompt')).__name__}")

    def make(row: dict[str, Any]) -> SkyRLGymAdapter:
        env = skyrl_gym.make(spec, env_config=env_config, extras=row)
        return SkyRLGymAdapter(env, list(row["prompt"]))

    return RecordEpisodeEnv(name=f"skyrl:{spec}", records=records, make_env=make,
                            runner=runner)


def areal_env(spec: str, **options: Any) -> Env:
    """``areal:MODULE:ATTRIBUTE`` (module docstring)."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ConfigError(f"env kind 'areal': {spec!r} is not MODULE:ATTRIBUTE")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"env kind 'areal': cannot load {spec!r}: {exc}") from exc
    records = _records("areal", options)
    gateway = options.pop("gateway", None)
    tokenizer, chat_template = options.pop("tokenizer", None), options.pop("chat_template", None)
    name = f"areal:{spec}"
    if hasattr(found, "arun_episode"):
        if not callable(found):
            raise ConfigError(f"{spec!r} is a collector instance; name its class (one is "
                              "built per episode)")
        if gateway is not None or tokenizer is not None:
            raise ConfigError("the 'gateway' and 'tokenizer' options are for AReaL workflows, "
                              "not collectors")
        make_collector: Callable[[], Any] = lambda: found(**options)  # noqa: E731
        make_collector()  # bad options fail at start-up
        return ArealCollectorEnv(name, make_collector, records)
    workflow = found(**options) if isinstance(found, type) else found
    if not callable(getattr(workflow, "run", None)):
        raise ConfigError(f"{spec!r} is neither an AReaL workflow (run(data, base_url=, ...)) "
                          "nor a RolloutCollector (arun_episode)")
    if options and not isinstance(found, type):
        raise ConfigError(f"{spec!r} is an instance and takes no options")
    if chat_template is not None and tokenizer is None:
        raise ConfigError("the 'chat_template' option needs 'tokenizer' (the served model's)")
    if tokenizer is not None and gateway is not None:
        raise ConfigError("the 'tokenizer' option is the in-process gateway's: give it to "
                          "the rollq gateway (--tokenizer) instead")
    template = None if tokenizer is None else LocalTemplate.load(
        str(tokenizer), None if chat_template is None else str(chat_template))
    return areal_workflow_env(name, workflow, records,
                              gateway=None if gateway is None else RemoteGateway(str(gateway)),
                              template=template)
