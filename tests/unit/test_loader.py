"""Loading tiny random Hugging Face checkpoints back: config fields and weights."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.engine.models.loader import iter_weights
from tandem.model_config import ModelConfig, load_config

TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def save(config, path: Path, **save_kwargs) -> dict[str, torch.Tensor]:
    """Save a random model built from `config`; return the state dict that was written."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, **save_kwargs)
    state = model.state_dict()
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def assert_weights_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = dict(iter_weights(path))
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name].float()), name


def test_llama(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    # transformers adds rope_theta to the dict it is given, so it gets a copy.
    config = LlamaConfig(**TINY, rope_parameters=dict(rope), eos_token_id=[2, 3], bos_token_id=1)
    state = save(config, tmp_path)

    assert load_config(tmp_path) == ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_ids=(2, 3),
    )
    # rope_scaling is left out of ModelConfig equality.
    assert load_config(tmp_path).rope_scaling == rope
    assert_weights_equal(tmp_path, state)


def test_qwen2_has_bias_and_default_head_dim(tmp_path: Path) -> None:
    state = save(Qwen2Config(**TINY, eos_token_id=5), tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.architecture == "qwen2"
    assert cfg.head_dim == 8
    assert cfg.attention_bias and not cfg.qk_norm
    assert cfg.eos_token_ids == (5,)
    assert cfg.rope_scaling is None
    assert "model.layers.1.self_attn.k_proj.bias" in state
    assert_weights_equal(tmp_path, state)


def test_qwen3_tied_with_qk_norm_and_wide_heads(tmp_path: Path) -> None:
    config = Qwen3Config(**TINY, head_dim=16, attention_bias=True, tie_word_embeddings=True)
    state = save(config, tmp_path)
    cfg = load_config(tmp_path)
    assert (cfg.architecture, cfg.head_dim, cfg.q_size, cfg.kv_size) == ("qwen3", 16, 64, 32)
    assert cfg.qk_norm and cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == ()
    assert "lm_head.weight" not in state
    assert "model.layers.0.self_attn.q_norm.weight" in state
    assert_weights_equal(tmp_path, state)


def test_sharded_bfloat16_is_upcast(tmp_path: Path) -> None:
    config = LlamaConfig(**TINY, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_weights_equal(tmp_path, model.state_dict())


def test_pre_v5_rope_keys(tmp_path: Path) -> None:
    """Hub checkpoints written before transformers 5 carry rope_theta and rope_scaling."""
    save(LlamaConfig(**TINY), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["rope_parameters"]
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0}


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_config(tmp_path)


def test_missing_safetensors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        list(iter_weights(tmp_path))


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, sliding_window=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    assert load_config(tmp_path).max_position_embeddings == 64


def test_gguf_tokenizer_is_cached(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.engine.models.loader import load_tokenizer

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    built = load_tokenizer(smollm2_path)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer(smollm2_path)
    assert cached.name_or_path == str(saved)
    text = "Hello world, naïve café 🙂\n  def f(x): return x"
    ids = built(text)["input_ids"]
    assert cached(text)["input_ids"] == ids
    assert cached.decode(ids) == built.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(
        chat, tokenize=False
    )
    assert (cached.bos_token_id, cached.eos_token_id) == (built.bos_token_id, built.eos_token_id)
