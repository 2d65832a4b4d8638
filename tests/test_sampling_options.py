"""``--sampling-option KEY=VALUE`` and the ``sampling_options`` setting of ``rollq workers``:
values parsed as JSON where they parse; fields rollq owns refused; top_k, seed and stop set
those sampling fields (the request bodies are checked end to end in
``tests/producers/test_env_kinds.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rollq.ops.cli import build_parser
from rollq.ops.cli.common import key_values
from rollq.ops.settings import WorkerSettings, load_settings
from rollq.schemas import ConfigError


def parsed(*pairs: str) -> dict[str, object] | None:
    argv = ["workers"]
    for pair in pairs:
        argv += ["--sampling-option", pair]
    args: argparse.Namespace = build_parser().parse_args(argv)
    return key_values(args.sampling_options, "--sampling-option") if args.sampling_options else None


def test_values_are_json_where_they_parse() -> None:
    assert parsed() is None
    assert parsed("min_p=0.05", "structured_outputs={\"choice\": [\"yes\", \"no\"]}",
                  "stop=</answer>", "skip_special_tokens=false", "bad_words=[\"x\"]") == {
        "min_p": 0.05, "structured_outputs": {"choice": ["yes", "no"]}, "stop": "</answer>",
        "skip_special_tokens": False, "bad_words": ["x"]}
    assert parsed("note=a=b") == {"note": "a=b"}  # the first = splits
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parsed("min_p")


def test_fields_rollq_owns_are_refused_with_what_to_use(tmp_path: Path) -> None:
    for key, hint in [("max_tokens", "--max-tokens"), ("temperature", "--temperature"),
                      ("logprobs", "rollq sets it"), ("n", "rollq sets it")]:
        with pytest.raises(ValueError, match=hint):
            WorkerSettings(sampling_options={key: 1})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        WorkerSettings(sampling_options={"top_k": "ten"})
    with pytest.raises(ValueError, match="stop must be"):
        WorkerSettings(sampling_options={"stop": [1]})
    config = tmp_path / "rollq.yaml"
    config.write_text("workers:\n  sampling_options:\n    min_p: 0.1\n    seed: 3\n")
    settings = load_settings(WorkerSettings, environ={}, config_file=config)
    assert settings.sampling_options == {"min_p": 0.1, "seed": 3}
