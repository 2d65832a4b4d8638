"""How a settings field becomes a flag, an environment variable and a value type.

Pure functions of a pydantic ``FieldInfo`` (``ops.settings`` declares the fields, the CLI
and ``ops.docs_settings`` read them through these), so that one field gives one flag, one
``ROLLQ_*`` variable and one line of the settings reference.
"""

from __future__ import annotations

from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ENV_PREFIX = "ROLLQ_"


def flag_name(name: str, field: FieldInfo) -> str:
    """A setting's command-line flag: its name with dashes (``redis_url``: ``--redis-url``);
    a mapping's flag is singular and repeatable (``env_options``: ``--env-option KEY=VALUE``)."""
    if get_origin(value_type(field)) is dict:
        name = name.removesuffix("s")
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """A setting's environment variable: ``ROLLQ_`` and its name in capitals."""
    return ENV_PREFIX + name.upper()


def value_type(field: FieldInfo) -> Any:
    """A field's type without ``None`` (``int | None``: ``int``); pydantic keeps an
    ``Annotated`` field's checks in ``field.metadata``, so this is the bare type."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not NoneType]
        if len(rest) == 1:
            return rest[0]
    return annotation


def default_value(field: FieldInfo) -> Any:
    """A field's default, its factory called (every settings factory takes no argument)."""
    if field.default is PydanticUndefined and field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default
