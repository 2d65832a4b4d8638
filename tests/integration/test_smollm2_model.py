"""The converted SmolLM2-135M-Instruct folder against its own GGUF (no vLLM needed).

The tokenizer must be the GGUF's: the same 49,152 ids, every token that is text on its own
encoding back to itself, real text round-tripping, digits one token each, ChatML ids. The
weights are proven against vLLM in ``test_smollm2_vllm.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollq.ops.local.artifacts import SMOLLM2_GGUF, default_cache_dir, fetch
from rollq.ops.local.smollm2 import GGUF_FILE

gguf = pytest.importorskip("gguf", reason="needs the models extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

pytestmark = pytest.mark.slow  # the first run fetches (98 MB) and converts the model

REAL_TEXT = [
    "Nothing is lost on a restart (Redis holds every group until a trainer acks it).",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "In 2024, 1,234.56 € bought 3½ café crèmes — «très bien» 😀\t\n\n  spaced   out",
    "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_fields() -> dict[str, Any]:
    import os

    reader = gguf.GGUFReader(str(fetch(SMOLLM2_GGUF, default_cache_dir(os.environ))
                                 / GGUF_FILE))
    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tokenizer(smollm2_model: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(smollm2_model)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level table, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def test_the_vocabulary_is_the_ggufs_and_every_text_token_encodes_to_itself(
        tokenizer: Any, gguf_fields: dict[str, Any]) -> None:
    tokens, types = gguf_fields["tokenizer.ggml.tokens"], gguf_fields["tokenizer.ggml.token_type"]
    assert len(tokenizer) == len(tokens) == 49152
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == list(tokens)
    decoder, checked, wrong = _byte_decoder(), 0, []
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == 3:
            continue
        try:  # a token holding part of a character is not text alone (313 such)
            text = bytes(decoder[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        checked += 1
        if tokenizer.encode(text, add_special_tokens=False) != [index]:
            wrong.append((index, token))
    assert checked > 48000 and wrong == []  # measured: 48,822 checked, none wrong


def test_control_tokens_chatml_and_digits(tokenizer: Any, gguf_fields: dict[str, Any],
                                          smollm2_model: Path) -> None:
    control = [t for t, kind in zip(gguf_fields["tokenizer.ggml.tokens"],
                                    gguf_fields["tokenizer.ggml.token_type"], strict=True)
               if kind == 3]
    assert [tokenizer.convert_tokens_to_ids(t) for t in control] == list(range(17))
    added = tokenizer.added_tokens_decoder
    assert all(added[index].special and added[index].content == token
               for index, token in enumerate(control))
    assert tokenizer.encode("<|im_start|><|im_end|><file_sep>") == [1, 2, 5]  # one id each
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    assert json.loads((smollm2_model / "generation_config.json").read_text())[
        "eos_token_id"] == 2
    assert tokenizer.tokenize("x=20481") == ["x", "=", "2", "0", "4", "8", "1"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                      "trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert tokenizer.chat_template == gguf_fields["tokenizer.chat_template"]


@pytest.mark.parametrize("text", REAL_TEXT)
def test_real_text_round_trips(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merged, not byte by byte
