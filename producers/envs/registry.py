"""``make_env(name, **options)``: envs by name for the CLI.

Built-in names:

- ``gsm8k``: GSM8K-style dataset env; ``source`` defaults to the shipped sample
  (``producers/data/gsm8k_sample.jsonl``, 200 arithmetic word problems).
- ``math``: MATH-style dataset env; ``source`` is required.
- ``guess``: the number-guessing game (``producers.envs.guess``) as an ``EpisodeEnv``.
- ``sums``: single-digit sums (``producers.envs.sums``); ``split`` is ``train`` (default),
  ``heldout`` or ``all``; ``source`` defaults to the shipped ``sums.jsonl``.
- ``tools``: one-digit arithmetic (``+ - *``) answered by an ``openai`` agent with a
  ``calc`` tool (``producers.envs.tools``); ``gateway`` (a ``rollq gateway`` URL; default:
  in-process), ``split``, ``source``, ``max_tokens`` (per call). Needs the ``openai``
  package.
- ``gem:ENV_ID``, ``skyrl:ENV_ID``, ``areal:MODULE:ATTRIBUTE``: other ecosystems' envs
  (``producers.envs.kinds``); ``reasoning_gym:TASK[+TASK...]`` reasoning-gym's tasks
  (``producers.envs.reasoning_gym``); ``openenv:URL`` or ``openenv:MODULE[:APP]`` an
  OpenEnv env server (``producers.envs.openenv``).

Dataset envs take ``source``, ``split``, ``subset``, ``data_files``, ``mode`` (``chat`` or
``completion``), ``template``, ``system_prompt``. ``guess`` takes ``low``, ``high``,
``max_guesses``, ``size``, ``first_seed``, ``max_turns``, ``max_completion_tokens``,
``system_prompt``, ``truncated_turn``, ``truncated_turn_penalty``.

An env *kind* prefix loads another ecosystem's env through its adapter, when the optional
package is installed: ``KIND:SPEC`` where ``KIND`` is a key of ``KINDS`` (the adapter is
imported only when named, so the core never needs the package).

Any other name of the form ``package.module:attribute`` is imported: an ``Env`` instance
is returned as is; a callable (class or factory) is called with the options. An
``AgentEnv`` (episodes that call the model themselves, ``run_episode``) is wrapped in
``ClientEpisodeEnv``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import resources
from typing import Any

from rollq.producers.envs.base import AgentEnv, Env
from rollq.producers.envs.dataset import PromptStyle, gsm8k_env, math_env
from rollq.producers.envs.episode import ClientEpisodeEnv
from rollq.producers.envs.guess import GuessGame
from rollq.producers.envs.multiturn import EpisodeEnv, EpisodeRunner, TruncatedTurn
from rollq.producers.envs.sums import sums_env
from rollq.schemas import ConfigError

_STYLE_OPTIONS = ("mode", "template", "system_prompt")


def sample_path() -> str:
    """Path of the shipped GSM8K-format sample file."""
    return str(resources.files("rollq.producers.data").joinpath("gsm8k_sample.jsonl"))


def _dataset(build: Callable[..., Env], default_source: str | None) -> Callable[..., Env]:
    def make(**options: Any) -> Env:
        style = PromptStyle(**{key: options.pop(key) for key in _STYLE_OPTIONS if key in options})
        source = options.pop("source", default_source)
        if source is None:
            raise ConfigError("this env needs a 'source' option (a file or dataset name)")
        return build(source, style=style, **options)

    return make


def _guess(*, low: int = 1, high: int = 16, max_guesses: int = 6, size: int = 1000,
           first_seed: int = 0, max_turns: int | None = None,
           max_completion_tokens: int | None = None, system_prompt: str | None = None,
           truncated_turn: TruncatedTurn = "end_episode",
           truncated_turn_penalty: float = -1.0) -> Env:
    runner = EpisodeRunner(system_prompt=system_prompt, max_turns=max_turns or max_guesses,
                           max_completion_tokens=max_completion_tokens,
                           truncated_turn=truncated_turn,
                           truncated_turn_penalty=truncated_turn_penalty)
    return EpisodeEnv(name="guess", make_env=lambda: GuessGame(low, high, max_guesses),
                      size=size, first_seed=first_seed, runner=runner)


def _sums(**options: Any) -> Env:
    style = PromptStyle(**{key: options.pop(key) for key in _STYLE_OPTIONS if key in options})
    return sums_env(style=style, **options)


def _tools(**options: Any) -> Env:
    try:
        from rollq.producers.envs.tools import tools_env
    except ImportError as exc:  # the agent is written with the openai package
        raise ConfigError(f"env 'tools' needs the openai package (pip install openai): "
                          f"{exc}") from exc
    return tools_env(**options)


BUILTIN: dict[str, Callable[..., Env]] = {
    "gsm8k": _dataset(gsm8k_env, None),
    "math": _dataset(math_env, None),
    "guess": _guess,
    "sums": _sums,
    "tools": _tools,
}


KINDS: dict[str, str] = {
    "gem": "rollq.producers.envs.kinds:gem_env",  # gem:ENV_ID (extra gem)
    "skyrl": "rollq.producers.envs.kinds:skyrl_env",  # skyrl:ENV_ID (extra skyrl)
    "areal": "rollq.producers.envs.kinds:areal_env",  # areal:MODULE:ATTRIBUTE
    "atropos": "rollq.producers.envs.atropos:atropos_env",  # atropos:MODULE:CLASS (extra)
    # reasoning_gym:TASK[+TASK...] (extra reasoning-gym)
    "reasoning_gym": "rollq.producers.envs.reasoning_gym:reasoning_gym_env",
    "openenv": "rollq.producers.envs.openenv:openenv_env",  # openenv:URL|MODULE[:APP] (extra)
}
"""Env kinds by prefix: ``--env KIND:SPEC`` calls the factory at this ``module:attribute``
path as ``factory(SPEC, **options)``. Adapters for optional packages register here."""


def make_env(name: str, **options: Any) -> Env:
    """The env called ``name`` (built-in or ``module:attribute``), built with ``options``.

    Raises ``ConfigError`` for an unknown name, a failed import, or bad options.
    """
    if name == "gsm8k":
        options.setdefault("source", sample_path())
    kind, _, spec = name.partition(":")
    if kind in KINDS and spec:
        return _checked(name, _import(KINDS[kind]), options, spec)
    if name in BUILTIN:
        factory: Any = BUILTIN[name]
    elif ":" in name:
        factory = _import(name)
    else:
        raise ConfigError(f"unknown env {name!r}; choose one of {sorted(BUILTIN)} or give "
                          "a 'package.module:attribute' path")
    if isinstance(factory, AgentEnv) and not isinstance(factory, Env) and not callable(factory):
        factory = ClientEpisodeEnv(factory)  # an agent env: its episodes call the model
    if isinstance(factory, Env) and not callable(factory):
        if options:
            raise ConfigError(f"env {name!r} is an instance and takes no options")
        return factory
    return _checked(name, factory, options)


def _checked(name: str, factory: Any, options: dict[str, Any], *args: Any) -> Env:
    try:
        env = factory(*args, **options)
    except TypeError as exc:
        raise ConfigError(f"bad options for env {name!r}: {exc}") from exc
    if isinstance(env, AgentEnv) and not isinstance(env, Env):
        env = ClientEpisodeEnv(env)
    if not isinstance(env, Env):
        raise ConfigError(f"{name!r} did not produce an Env (got {type(env).__name__})")
    return env


def _import(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load env {path!r}: {exc}") from exc
