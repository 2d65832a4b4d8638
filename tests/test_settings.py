"""Settings precedence and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollq.ops.settings import FeederSettings, ScorerSettings, WorkerSettings, load_settings
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
