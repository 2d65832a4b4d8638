"""What every rollq command shares: exit codes, the settings flags, settings and a client.

A role's flags are not written by hand: ``add_settings_flags`` makes one flag per field of
the settings model the command builds (``ops.setting_fields.flag_name``), its help the field's
docstring, and ``settings_for`` reads them back. The command modules (``ops.cli.roles``,
``inspect``, ``dead``, ``runs``, ``servers``, ``local``) import these from here and
``ops.cli`` puts them together into the parser: ``ops.cli`` -> command modules -> here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Collection, Coroutine, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import redis.asyncio as aioredis
import structlog
import yaml
from pydantic.fields import FieldInfo

from rollq.ops.logging import configure_logging
from rollq.ops.setting_fields import default_value, env_name, flag_name, value_type
from rollq.ops.settings import CommonSettings, load_settings
from rollq.schemas import ConfigError


class Exit(IntEnum):
    """Exit codes of every rollq command."""

    OK = 0
    FAILURE = 1  # the command ran and failed (e.g. a test run of the demo did not learn)
    USAGE = 2  # argparse's own code for bad flags
    NOT_FOUND = 3  # the run (or entry) asked for does not exist
    UNAVAILABLE = 69  # Redis or the inference servers cannot be reached (EX_UNAVAILABLE)
    CONFIG = 78  # invalid settings or reward config (EX_CONFIG)
    INTERRUPTED = 130


Handler = Callable[[argparse.Namespace, Mapping[str, str]], Coroutine[Any, Any, int]]

ONE_SHOT = ("metrics_port",)
"""Settings a command that serves nothing has no use for (``add_settings_flags``' skip)."""


def add_settings_flags(parser: argparse.ArgumentParser, model: type[CommonSettings], *,
                       skip: Collection[str] = ()) -> None:
    """``--config`` and one flag per field of ``model`` (but ``skip``): the settings every
    role shares in one group, the role's own in another."""
    parser.add_argument("--config", type=Path, metavar="YAML",
                        help="YAML config file (docs/reference/settings.md) [ROLLQ_* variables "
                        "and flags win over it]")
    shared = parser.add_argument_group("settings every command shares")
    own = parser.add_argument_group(
        f"{model.model_fields['section'].default or 'its'} settings")
    for name, field in model.model_fields.items():
        if name == "section" or name in skip:
            continue
        group = shared if name in CommonSettings.model_fields else own
        group.add_argument(flag_name(name, field), dest=name, default=None,
                           help=_help(name, field), **_kind(name, field))


def _kind(name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse's ``type``/``action``/``nargs`` for the field's type."""
    kind = value_type(field)
    origin = get_origin(kind)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": get_args(kind)}
    if origin is dict:
        return {"action": "append", "metavar": "KEY=VALUE"}
    if origin is list:  # several values, each may be comma-separated
        return {"nargs": "+", "metavar": name.upper()}
    if kind is int:
        return {"type": int, "metavar": "N"}
    if kind is float:
        return {"type": float, "metavar": "S" if name.endswith("_s") else "X"}
    if kind is Path:
        return {"type": Path, "metavar": "FILE"}
    return {"metavar": name.upper()}


def _help(name: str, field: FieldInfo) -> str:
    text = " ".join((field.description or "").replace("``", "").split())
    default = default_value(field)
    shown = ("off" if default is None else ",".join(map(str, default))
             if isinstance(default, list) else "{}" if default == {} else str(default) or '""')
    more = " (repeatable; VALUE read as JSON, else YAML)" if isinstance(default, dict) else ""
    return f"{text}{more} [{env_name(name)}; default {shown}]".replace("%", "%%")


def settings_for(cls: type[Any], args: argparse.Namespace, environ: Mapping[str, str],
                 **overrides: Any) -> Any:
    """Load a role's settings from its flags (those ``add_settings_flags`` made, then
    ``overrides``), the environment and the config file, then configure logging from them.

    The settings are also kept on ``args``, so ``main`` can word a failure with them.
    """
    given: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        value = getattr(args, name, None)
        if value is None or name == "section":
            continue
        kind = get_origin(value_type(field))
        if kind is dict:
            value = key_values(value, flag_name(name, field))
        elif kind is list:
            value = [part for each in value for part in each.split(",") if part]
        given[name] = value
    settings = load_settings(cls, environ=environ, config_file=getattr(args, "config", None),
                             overrides={**given, **overrides})
    configure_logging(settings.log_format, settings.log_level)
    # Every line the command writes carries its run (the handler runs in its own task
    # context, so this binding ends with it).
    structlog.contextvars.bind_contextvars(run=settings.run)
    args.settings = settings
    return settings


def key_values(pairs: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` flags as a mapping; a VALUE is JSON where it parses (``1e-3``,
    ``{"regex": "[0-9]+"}``), else YAML (``a: 1``), else the text itself."""
    found: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {pair!r}: expected KEY=VALUE")
        try:
            found[key] = json.loads(value)
        except ValueError:
            try:
                found[key] = yaml.safe_load(value)
            except yaml.YAMLError:
                found[key] = value
    return found


def redis_client(settings: CommonSettings) -> aioredis.Redis:
    from rollq.ops.connections import open_redis

    return open_redis(settings)


def not_found(run: str, runs: list[str]) -> int:
    """Say that ``run`` is not in Redis (and which are) and return ``Exit.NOT_FOUND``."""
    known = ", ".join(runs) if runs else "none yet"
    print(f"rollq: run {run!r} not found (known runs: {known}); pass --run or ROLLQ_RUN",
          file=sys.stderr)
    return Exit.NOT_FOUND
