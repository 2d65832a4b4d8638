"""The bodies match atroposlib 0.4.0's own pydantic models, field by field."""

from __future__ import annotations

from typing import Any

import pytest

server = pytest.importorskip("atroposlib.api.server",
                             reason="atroposlib is not installed (pip install rollq[atropos])")

from rollq.ops.atropos import models  # noqa: E402


def _schema(model: Any) -> dict[str, Any]:
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("title", "description")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(model.model_json_schema())  # type: ignore[no-any-return]


@pytest.mark.parametrize(("name", "atroposlib_name"), [
    ("TrainerRegistration", "Registration"), ("RegisterEnv", "RegisterEnv"),
    ("EnvIdentifier", "EnvIdentifier"), ("ScoredData", "ScoredData"), ("Status", "Status"),
    ("Info", "Info")])
def test_model_matches_atroposlib_field_by_field(name: str, atroposlib_name: str) -> None:
    ours, theirs = getattr(models, name), getattr(server, atroposlib_name)
    assert list(ours.model_fields) == list(theirs.model_fields)
    for field, info in theirs.model_fields.items():
        mine = ours.model_fields[field]
        assert mine.is_required() == info.is_required(), field
        assert mine.default == info.default, field
    assert _schema(ours) == _schema(theirs)


def test_scored_data_field_list_matches_the_env_typed_dict() -> None:
    from atroposlib.envs.base import ScoredDataGroup

    assert set(ScoredDataGroup.__annotations__) | {"env_id"} == set(models.SCORED_DATA_FIELDS)


@pytest.mark.parametrize("messages", [[[{"role": "user"}]], [[{"content": "x"}]]])
def test_messages_need_role_and_content_as_in_atroposlib(messages: Any) -> None:
    body = {"tokens": [[1]], "masks": [[1]], "scores": [1.0], "messages": messages}
    with pytest.raises(ValueError, match="'role' and 'content'"):
        server.ScoredData.model_validate(body)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        models.ScoredData.model_validate(body)
