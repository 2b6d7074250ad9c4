"""The CUDA-graph step logic that needs no GPU: buckets, the key a step takes, its padding, the
eager fallback; and which attention backend an engine gets (`backend_class`)."""

from __future__ import annotations

import pytest
import torch

from tandem.config import ModelSettings
from tandem.engine.attention import (
    PagedLists,
    SeqSpec,
    TorchSDPABackend,
    TritonPagedBackend,
    backend_class,
    paged_lists,
    triton_installed,
)
from tandem.engine.cuda_graphs import (
    PAD_SLOT,
    GraphKey,
    batch_buckets,
    choose_key,
    graph_keys,
    pack,
    packed_metadata,
    packed_size,
    pad_lists,
)


def test_batch_buckets() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(10) == (1, 2, 4, 8, 10)
    assert batch_buckets(1) == (1,)


def test_choose_key_takes_the_fewest_padding_tokens_else_none() -> None:
    keys = graph_keys((1, 2, 4, 8), (1, 6))  # decodes, and verifications of 5 drafts
    assert choose_key(keys, 1, 1) == GraphKey(1, 1)
    assert choose_key(keys, 3, 1) == GraphKey(4, 1)
    assert choose_key(keys, 3, 2) == GraphKey(4, 6)  # a verification of 1 draft
    assert choose_key(keys, 8, 6) == GraphKey(8, 6)
    assert choose_key(keys, 9, 1) is None  # above the largest bucket: eager
    assert choose_key(keys, 1, 7) is None  # a longer query (a prefill chunk): eager


def test_pad_lists_pads_tokens_and_requests_with_nothing_to_attend() -> None:
    seqs = [SeqSpec(3, 1, [5]), SeqSpec(17, 2, [1, 2])]  # a decode, a verification
    lists = paged_lists(seqs, 16)
    assert lists == PagedLists([83, 33, 34], [[5, 0], [1, 2]], [0, 1, 3], [4, 19])
    padded = pad_lists(lists, GraphKey(4, 2))
    assert padded.slot_mapping == [83, 33, 34] + [PAD_SLOT] * 5  # 4 x 2 tokens
    assert padded.block_tables == [[5, 0], [1, 2], [0, 0], [0, 0]]
    assert padded.query_starts == [0, 1, 3, 3, 3]  # padding requests hold no token
    assert padded.context_lens == [4, 19, 0, 0]  # ... and no context
    assert pad_lists(lists, GraphKey(2, 2)).slot_mapping == [83, 33, 34, PAD_SLOT]


def test_pack_writes_what_the_graph_metadata_reads() -> None:
    key, max_blocks = GraphKey(4, 2), 5
    buffer = torch.full((packed_size(key, max_blocks),), 99, dtype=torch.int32)
    meta = packed_metadata(buffer, key, max_blocks, num_splits=2)
    seqs = [SeqSpec(3, 1, [5]), SeqSpec(17, 2, [1, 2])]
    pack(pad_lists(paged_lists(seqs, 16), key), buffer.numpy(), key)
    assert meta.slot_mapping.tolist() == [83, 33, 34] + [PAD_SLOT] * 5
    assert meta.query_starts.tolist() == [0, 1, 3, 3, 3]
    assert meta.context_lens.tolist() == [4, 19, 0, 0]
    # the step's columns; the rest keep what they held
    assert (
        meta.block_tables.tolist()
        == [[5, 0, 99, 99, 99], [1, 2, 99, 99, 99]] + [[0, 0, 99, 99, 99]] * 2
    )
    assert (meta.max_query_len, meta.num_splits) == (2, 2)


def test_pad_lists_refuses_a_step_larger_than_the_key() -> None:
    lists = paged_lists([SeqSpec(0, 3, [0]), SeqSpec(4, 1, [1])], 16)
    with pytest.raises(ValueError, match="exceeds"):
        pad_lists(lists, GraphKey(1, 4))
    with pytest.raises(ValueError, match="exceeds"):
        pad_lists(lists, GraphKey(2, 1))


def test_the_cpu_path_keeps_sdpa_whatever_the_setting_allows() -> None:
    cpu = torch.device("cpu")
    assert backend_class("auto", cpu, torch.float32) is TorchSDPABackend
    assert backend_class("sdpa", cpu, torch.float32) is TorchSDPABackend
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        backend_class("triton", cpu, torch.float32)


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_cuda_engines_take_triton_by_default_and_keep_sdpa_as_fallback() -> None:
    # The device is only named: nothing is allocated on it.
    cuda = torch.device("cuda")
    assert backend_class("auto", cuda, torch.bfloat16) is TritonPagedBackend
    assert backend_class("triton", cuda, torch.float32) is TritonPagedBackend
    assert backend_class("sdpa", cuda, torch.bfloat16) is TorchSDPABackend
    # where the kernels do not apply, "auto" falls back and "triton" says why
    assert backend_class("auto", cuda, torch.int8) is TorchSDPABackend
    with pytest.raises(ValueError, match="float caches only"):
        backend_class("triton", cuda, torch.float8_e4m3fn)


def test_attention_backend_setting_is_checked() -> None:
    assert ModelSettings().attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelSettings(attention_backend="flash")


def test_steps_no_graph_holds_run_eagerly() -> None:
    """A runner with graphs for batch 1 decodes: a batch of 2 and a prefill chunk take the eager
    path (on CPU, where capturing would fail) and compute what a runner without graphs does."""
    from tandem.engine.cuda_graphs import CudaGraphs
    from tandem.engine.models.llama import LlamaForCausalLM
    from tandem.engine.request import Request
    from tandem.engine.runner import ModelRunner
    from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
    from tandem.model_config import ModelConfig
    from tandem.sampling_params import SamplingParams

    cfg = ModelConfig("llama", 64, 32, 64, 1, 4, 2, 8, max_position_embeddings=64)
    cpu = torch.device("cpu")
    tokens = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg, TorchSDPABackend(4, 2, 8, 16), torch.float32, cpu)
        runner = ModelRunner(model, 8, 16, torch.float32, cpu)
        if graphs:
            runner.graphs = CudaGraphs(model, (1,), (1,), 64)
        params = SamplingParams(temperature=0.0)
        a, b = Request("a", [1, 2, 3, 4, 5], params), Request("b", [6, 7], params)
        prefill = SchedulerOutput([ScheduledRequest(a, 5), ScheduledRequest(b, 2)], [])
        tables = {"a": [0], "b": [1]}
        first = runner.execute(prefill, tables).tokens
        for r in (a, b):
            r.num_computed_tokens = r.num_tokens
            r.append_output(first[r.request_id][0], 0.0)
        decode = SchedulerOutput([ScheduledRequest(a, 1), ScheduledRequest(b, 1)], [])
        tokens[graphs] = (first, runner.execute(decode, tables).tokens)
    assert tokens[True] == tokens[False]
