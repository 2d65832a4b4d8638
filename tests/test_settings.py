"""Settings: precedence, errors naming a value's origin, and flags made from the models."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rollq.ops.cli import build_parser
from rollq.ops.cli.common import settings_for
from rollq.ops.settings import (
    AtroposApiSettings,
    CommonSettings,
    FeederSettings,
    GatewaySettings,
    ScorerSettings,
    WorkerSettings,
    env_name,
    flag_name,
    load_settings,
)
from rollq.schemas import ConfigError


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config = tmp_path / "rollq.yaml"
    config.write_text("run: from-file\nbatch_groups: 4\nfeeder:\n  max_staleness: 3\n"
                      "scorer:\n  concurrency: 2\n")
    settings = load_settings(FeederSettings, environ={"ROLLQ_RUN": "from-env"},
                             config_file=config, overrides={"epochs": 5, "run": None})
    assert settings.run == "from-env"
    assert settings.batch_groups == 4 and settings.max_staleness == 3
    assert settings.epochs == 5 and settings.poll_s == 0.2


def test_list_settings_split_on_commas() -> None:
    settings = load_settings(WorkerSettings, environ={
        "ROLLQ_INFERENCE": "http://a:8000,http://b:8000"})
    assert settings.inference == ["http://a:8000", "http://b:8000"]


@pytest.mark.parametrize(("text", "message"), [
    ("runn: typo\n", "unknown setting 'runn'"),
    ("scorer:\n  concurency: 3\n", "concurency"),
    ("- a list\n", "must be a mapping"),
    ("run: 'bad name!'\n", r"run \(from"),
])
def test_config_file_errors_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "rollq.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(ScorerSettings, environ={}, config_file=config)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(ScorerSettings, environ={}, config_file=tmp_path / "none.yaml")


# -- one declaration per setting: the flags are made from the models ----------------------

COMMAND_MODELS = {"workers": WorkerSettings, "feed": FeederSettings, "score": ScorerSettings,
                  "rescore": ScorerSettings, "atropos-api": AtroposApiSettings,
                  "gateway": GatewaySettings, "status": CommonSettings, "tail": CommonSettings}
SWITCHES = {"help", "config", "burst", "into", "json", "watch", "stream", "from_start",
            "count", "width"}
"""A command's own flags that are not settings (what it does this time, not how the role
is configured)."""


def _options(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {action.dest: action for action in sub.choices[command]._actions}


@pytest.mark.parametrize("command", sorted(COMMAND_MODELS))
def test_every_setting_is_a_flag_named_and_described_by_its_field(command: str) -> None:
    model = COMMAND_MODELS[command]
    options = _options(command)
    for name, field in model.model_fields.items():
        if name == "section" or (name == "metrics_port" and command in ("status", "tail",
                                                                         "rescore")):
            continue
        action = options.pop(name)
        assert action.option_strings[0] == flag_name(name, field)  # bools: also --no-...
        assert action.default is None  # unset: the environment, file or default decide
        first_words = " ".join((field.description or "").replace("``", "").split()[:4])
        assert first_words and first_words in " ".join((action.help or "").split())
        assert env_name(name) in (action.help or "")
    assert set(options) <= SWITCHES, "a flag that is not a setting nor a known switch"


def test_flags_are_read_back_with_their_types_and_origin_named(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "workers", "--inference", "http://a:8000,http://b:8000", "http://c:8000",
        "--env-option", "source=train.jsonl", "--env-option", "limit=3",
        "--sampling-option", "min_p=1e-3", "--max-tokens", "24", "--no-redis-tls-verify",
        "--temperature", "0.5"])
    settings = settings_for(WorkerSettings, args, {"ROLLQ_MAX_TOKENS": "99",
                                                   "ROLLQ_GROUP_SIZE": "4"})
    assert settings.inference == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert settings.env_options == {"source": "train.jsonl", "limit": 3}
    assert settings.sampling_options == {"min_p": 0.001}
    assert settings.max_tokens == 24 and settings.group_size == 4  # flag > env > default
    assert settings.redis_tls_verify is False and settings.temperature == 0.5
    bad = build_parser().parse_args(["workers", "--group-size", "0"])
    with pytest.raises(ConfigError, match=r"group_size \(from --group-size\)"):
        settings_for(WorkerSettings, bad, {})
    with pytest.raises(ConfigError, match=r"group_size \(from ROLLQ_GROUP_SIZE\)"):
        settings_for(WorkerSettings, build_parser().parse_args(["workers"]),
                     {"ROLLQ_GROUP_SIZE": "0"})
    config = tmp_path / "rollq.yaml"
    config.write_text("gateway:\n  episode_ttl_s: -1\n")
    with pytest.raises(ConfigError, match=r"episode_ttl_s \(from .*rollq.yaml \[gateway\]\)"):
        settings_for(GatewaySettings, build_parser().parse_args(
            ["gateway", "--config", str(config)]), {})
