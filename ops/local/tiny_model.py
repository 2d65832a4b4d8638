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

torch / transformers / tokenizers are optional dependencies, imported lazily.

Usage: ``python -m rollq.ops.local.tiny_model DIR [--seed N]``
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>"]  # plain (non-special) added tokens, as in Qwen3
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


def _write_tokenizer(directory: Path, seed: int) -> int:
    """Train and save the BPE tokenizer; return its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.save(str(directory / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
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
    "100m": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
}


def write_tiny_model(directory: Path, *, seed: int = 0, shape: str = "tiny") -> Path:
    """Write a random Qwen2ForCausalLM + its tokenizer into ``directory`` and return it;
    ``shape`` picks the size from ``SHAPES`` (the same tokenizer for every size)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(directory, seed)
    pad_id, eos_id = 0, 2  # <|endoftext|>, <|im_end|> (special tokens come first)

    config = Qwen2Config(  # type: ignore[call-arg]  # transformers' stubs lag its kwargs
        vocab_size=vocab_size,
        **SHAPES[shape],
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
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
    args = parser.parse_args(argv)
    out = write_tiny_model(args.directory, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
