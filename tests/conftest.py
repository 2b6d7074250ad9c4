"""Shared fixtures."""

import os

# torch's OpenMP threads spin while they wait; on a 2-core machine shared with other processes
# the spinning starves the thread doing the work. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from tandem import hub
from tandem.engine.spec import adaptive, draft_length
from tandem.engine.spec.cost import DraftLengthControl


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny-model tests gain nothing from intra-op threads; on a busy machine the barrier waits
    cost seconds. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


class DraftsAsTheLimitsAllow(DraftLengthControl):
    """Test double of the cost model: every step drafts as many tokens as the acceptance and
    batch limits allow, whatever the measured times say."""

    def choose(self, acceptances: Any, caps: Any, num_decoding: int) -> int:
        return max(caps, default=0)


@pytest.fixture(autouse=True)
def speculate_in_any_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process engines draft up to a batch of 32 whatever the device: the exactness tests
    speculate in batches of 5, which CPU's default (no drafts from 4 running requests,
    spec/adaptive.py) would leave undrafted. And they draft whether or not it pays: draft counts
    that follow measured times (spec/cost.py) would make the tests of the drafting machinery
    depend on the machine's speed. Worker processes keep the defaults; the defaults themselves
    are tested in test_spec_adaptive.py and test_spec_cost.py."""
    monkeypatch.setattr(draft_length, "DraftLengthControl", DraftsAsTheLimitsAllow)
    monkeypatch.setattr(
        draft_length,
        "disable_batch_size",
        lambda configured, device: (
            adaptive.DEFAULT_DISABLE_BATCH_SIZE if configured is None else configured
        ),
    )


@pytest.fixture(scope="session")
def once_per_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, Callable[[], Any]], Any]:
    """`once_per_run(name, compute)`: `compute()`'s value, computed once in the whole test run.
    Under pytest-xdist the first worker to ask computes it under a file lock and leaves it
    pickled in the run's shared temporary directory, and the other workers read it there (the
    files of a session fixture can land on both workers). For what costs seconds and depends
    on nothing a test changes: a reference's scores."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return lambda name, compute: compute()
    root = tmp_path_factory.getbasetemp().parent  # the run's, shared by its workers

    def once(name: str, compute: Callable[[], Any]) -> Any:
        path = root / f"{name}.pickle"
        with FileLock(f"{path}.lock"):
            if not path.is_file():
                partial = path.with_suffix(".partial")  # a worker that dies leaves no half file
                partial.write_bytes(pickle.dumps(compute()))
                partial.replace(path)
            return pickle.loads(path.read_bytes())

    return once


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF, pulled once into the default store and reused."""
    return hub.pull("smollm2-135m")


TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="session")
def tiny_eagle_path(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """A random EAGLE head (seed 0) for the tiny model, saved in our layout (`save_eagle`)."""
    from dataclasses import replace

    from tandem.engine.attention import TorchSDPABackend
    from tandem.engine.models import load_model
    from tandem.engine.spec.eagle import EagleHead, save_eagle
    from tandem.engine.spec.heads import base_model_fields

    cpu, block_size = torch.device("cpu"), 16
    target = load_model(tiny_llama_path, TorchSDPABackend, block_size, torch.float32, cpu)
    cfg = replace(target.cfg, num_layers=1)
    backend = TorchSDPABackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    torch.manual_seed(0)
    head = EagleHead(cfg, backend, True, cfg.max_position_embeddings, torch.float32, cpu)
    path = tmp_path_factory.mktemp("eagle")
    save_eagle(head, path, base_model_fields(str(tiny_llama_path), target))
    return path


@pytest.fixture(scope="session")
def tiny_llama_kwargs() -> dict[str, int]:
    """The shape of the tiny random models (LlamaConfig/Qwen2Config/Qwen3Config keywords)."""
    return dict(TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (seed 0, vocab 256, EOS id 2) saved as a Hugging Face directory.

    Weights are drawn at 10x the default scale: the logits are peaked enough (top token ~0.1)
    that a sampled token depends on the model and not only on the sampling noise, and greedy
    near-ties are rare. Its tokenizer is byte-level BPE without merges, so its 256 tokens are
    exactly the bytes and `LLM` can load it; built offline in a second or two.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA, eos_token_id=2, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(path)
    byte_vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path


def _prompt_logits(
    engine: Any, ids: list[int], first: int = 0, rows: int | None = None
) -> torch.Tensor:
    from tandem.engine.attention import SeqSpec

    model, device = engine.model, engine.runner.device
    num_blocks = -(-len(ids) // engine.config.cache.block_size)
    # Fresh caches of the engine's layout ([2, num_blocks, ...]): the engine's own blocks may
    # hold prefix-cached KV that later requests read.
    kv_caches = [torch.zeros_like(c[:, :num_blocks]) for c in engine.runner.kv_caches]
    meta = model.backend.build_metadata([SeqSpec(0, len(ids), list(range(num_blocks)))], device)
    with torch.inference_mode():
        positions = torch.arange(len(ids), device=device)
        hidden = model(torch.tensor(ids, device=device), positions, kv_caches, meta)
        return torch.cat([model.compute_logits(h) for h in hidden[first:].split(rows or len(ids))])


@pytest.fixture(scope="session")
def prompt_logits() -> Callable[..., torch.Tensor]:
    """`prompt_logits(engine, ids, first=0, rows=None)`: the logits `[len(ids) - first, vocab]`
    (float32) an `EngineCore`'s model gives at positions `first:` of `ids`, in one forward over
    all of them, as for prompt log-probabilities; `rows` computes them that many rows at a time,
    as decode steps do (a quantized model's int8 LM head takes only few rows)."""
    return _prompt_logits
