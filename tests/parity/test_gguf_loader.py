"""GGUF loading: the real SmolLM2 file's tokenizer, and tiny GGUF files written here (quantized,
Q/K-permuted the way llama.cpp's converter does) read back exactly. The real file's weights and
config against transformers' GGUF loader: test_smollm2_greedy.py, which loads it once for them
and for its greedy tokens."""

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from tandem.engine.models.loader import _dequantize, iter_weights, load_tokenizer
from tandem.model_config import load_config

Q = gguf.GGMLQuantizationType


# --- the real model ---------------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer(smollm2_path: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]
    assert tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tokenizer.chat_template
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("Hello world")["input_ids"] == [19556, 905]


# --- tiny files written here ------------------------------------------------------------

TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
MATRIX_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.F32]


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    assert m is not None, hf_name
    return f"blk.{m[1]}.{GGUF_BLOCK_NAMES[m[2]]}.{m[3]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path, config: PretrainedConfig, arch: str, qtype: Callable[[str, int], Q]
) -> dict[str, torch.Tensor]:
    """Write a random model as llama.cpp would; return the weights a loader must give back."""
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # Qwen2's config has no head_dim; it is implied.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    # No {arch}.vocab_size: llama.cpp often leaves it out and the token list says it.
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    expected = {}
    for i, (name, tensor) in enumerate(state.items()):
        w = tensor.numpy()
        # ggml keeps 1-D tensors (norms, biases) in F32.
        t = qtype(name, i) if w.ndim == 2 else Q.F32
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        data = gguf.quants.quantize(w, t)
        writer.add_tensor(gguf_name(name), data, raw_dtype=t)
        # Quantization works on blocks within a row and the permutation moves whole rows, so
        # dequantizing the unpermuted matrix gives what the loader must return.
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), t), t)
        expected[name] = torch.from_numpy(np.array(roundtrip, dtype=np.float32)).reshape(
            tensor.shape
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def mixed_types(name: str, i: int) -> Q:
    return MATRIX_TYPES[i % len(MATRIX_TYPES)]


TINY_MODELS = {
    "llama": LlamaConfig(**TINY, head_dim=16),
    "qwen2": Qwen2Config(**TINY),
    "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_tiny_roundtrip(arch: str, tmp_path: Path) -> None:
    config = TINY_MODELS[arch]
    expected = write_gguf(tmp_path / "tiny.gguf", config, arch, mixed_types)
    loaded = dict(iter_weights(tmp_path / "tiny.gguf"))
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)

    # The same model saved the Hugging Face way describes the same architecture.
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    want = load_config(tmp_path / "hf")
    got = load_config(tmp_path / "tiny.gguf")
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # stored as float32
    assert got == replace(want, rms_norm_eps=got.rms_norm_eps)


def test_llama_qk_permutation_is_undone(tmp_path: Path) -> None:
    """With lossless F32 tensors the loaded q/k projections are the original ones, bit for bit."""
    config = TINY_MODELS["llama"]
    write_gguf(tmp_path / "tiny.gguf", config, "llama", lambda name, i: Q.F32)
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config).state_dict()
    loaded = dict(iter_weights(tmp_path / "tiny.gguf"))
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert torch.equal(loaded[name], original[name])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F32])
def test_dequantization_is_gguf_bit_for_bit(qtype: Q) -> None:
    """The loader dequantizes common block types in torch: the same float32 values as gguf."""
    w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype).view(np.uint8)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(_dequantize(raw, qtype), theirs)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    def q5_for_v(name: str, i: int) -> Q:
        return Q.Q5_0 if name == "model.layers.0.self_attn.v_proj.weight" else Q.F32

    write_gguf(tmp_path / "tiny.gguf", TINY_MODELS["llama"], "llama", q5_for_v)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight'.*Q5_0"):
        next(iter_weights(tmp_path / "tiny.gguf"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gemma.gguf", "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma'"):
        load_config(tmp_path / "gemma.gguf")
