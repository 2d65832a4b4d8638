"""How a model's reply becomes an OpenEnv action, and an observation the model's next message.

**Actions** (the ``openenv:`` kind's ``action`` option), parsers named in the config:

- ``text`` (default): the reply as the value of the action's one required string field,
  read from the server's ``GET /schema`` (``llm_response`` for DIPG's, ``message`` for an
  echo env); an action with several such fields, or none, needs one of the others.
- ``text:FIELD``: the reply as ``FIELD``.
- ``json``: the last JSON object in the reply (in a fenced block or bare) is the action.
- ``MODULE:FUNCTION``: your parser, ``FUNCTION(reply, observation) -> dict``, given the
  observation the reply answers; it raises ``ValueError`` for a reply that is no action.

A reply that is no action is the model's doing, not a failure: ``InvalidAction``, and the
episode ends with the kind's ``invalid_action_reward``.

**Observations** (the ``observation`` option) become one user message:

- automatic (default): the observation's fields but ``reward``, ``done`` and ``metadata``,
  empty ones left out; a single text field is the message as it is, several are
  ``name: value`` lines (other values as JSON);
- ``FIELD``: that field's value, as text;
- ``MODULE:FUNCTION``: your renderer, ``FUNCTION(observation) -> str`` (or a list of chat
  messages).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from rollq.producers.envs.observations import Observation
from rollq.producers.envs.openenv_session import InvalidAction
from rollq.schemas import ConfigError, ContractError

ActionParser = Callable[[str, Mapping[str, Any]], dict[str, Any]]
"""``(reply, observation) -> action``; raises ``InvalidAction``."""
Renderer = Callable[[Mapping[str, Any]], Observation]
"""``observation -> message text (or messages)``."""

NOT_SHOWN = ("reward", "done", "metadata")
"""Observation fields never rendered: the bridge keeps the reward and the end itself."""
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
_MOST_CANDIDATES = 64
"""Opening braces tried (from the end) when looking for a bare JSON object."""


def action_parser(option: str, schema: Mapping[str, Any] | None) -> ActionParser:
    """The parser an ``action`` option names; ``schema`` is the server's ``/schema`` (its
    ``action`` JSON schema is read by ``text``). ``ConfigError`` for one that cannot be."""
    if option == "json":
        return _json_action
    if option == "text" or option.startswith("text:"):
        field = option.removeprefix("text").removeprefix(":") or _text_field(schema)
        return lambda reply, observation: {field: reply}
    function = _load(option, "action")
    return _custom(function)


def renderer(option: str | None) -> Renderer:
    """The renderer an ``observation`` option names (None: automatic)."""
    if option is None:
        return render_observation
    if ":" in option:
        function = _load(option, "observation")
        return lambda observation: function(dict(observation))
    field = option

    def rendered(observation: Mapping[str, Any]) -> Observation:
        if field not in observation:
            raise ContractError(f"the env's observation has no field {field!r} (the "
                                f"observation option); it has {sorted(observation)}")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)

    return rendered


def render_observation(observation: Mapping[str, Any]) -> str:
    """The automatic rendering (module docstring)."""
    shown = {key: value for key, value in observation.items()
             if key not in NOT_SHOWN and value not in (None, "", [], {})}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return str(next(iter(shown.values())))
    return "\n".join(f"{key}: {value if isinstance(value, str) else json.dumps(value)}"
                     for key, value in shown.items())


def _text_field(schema: Mapping[str, Any] | None) -> str:
    action = (schema or {}).get("action") or {}
    properties = action.get("properties") or {}
    fields = [name for name in action.get("required") or []
              if (properties.get(name) or {}).get("type") == "string"]
    if len(fields) != 1:
        raise ConfigError(
            f"the env's action has {len(fields)} required text fields ({fields}; its schema: "
            f"{sorted(properties)}): name the field the reply goes in with the action "
            "option, action=text:FIELD, or parse the reply as JSON (action=json) or with "
            "your own parser (action=MODULE:FUNCTION)")
    return str(fields[0])


def _json_action(reply: str, observation: Mapping[str, Any]) -> dict[str, Any]:
    for block in reversed(_FENCED.findall(reply)):
        try:
            found = json.loads(block)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    decoder = json.JSONDecoder()
    starts = [match.start() for match in re.finditer(r"\{", reply)][-_MOST_CANDIDATES:]
    for start in reversed(starts):
        try:
            found, _end = decoder.raw_decode(reply, start)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    raise InvalidAction("the reply holds no JSON object (action=json)")


def _custom(function: Callable[..., Any]) -> ActionParser:
    def parsed(reply: str, observation: Mapping[str, Any]) -> dict[str, Any]:
        try:
            action = function(reply, dict(observation))
        except ValueError as exc:
            raise InvalidAction(f"the action parser refused the reply: {exc}") from exc
        if not isinstance(action, dict):
            raise ContractError(f"the action parser returned a {type(action).__name__}, "
                                "not an action (a dict)")
        return action

    return parsed


def _load(path: str, option: str) -> Callable[..., Any]:
    module_name, _, attribute = path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"the {option} option {path!r} names no function "
                          f"(MODULE:FUNCTION): {exc}") from exc
    if not callable(found):
        raise ConfigError(f"the {option} option {path!r} is not callable")
    return found  # type: ignore[no-any-return]
