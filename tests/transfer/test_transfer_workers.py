"""A prefill worker and a decode worker in two processes: the KV that arrives is the KV that was
sent, byte for byte, and decoding from it gives the colocated engine's greedy tokens exactly;
with EAGLE on both sides, the prompt's hidden states come along."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import WorkerProcess, engine_config, greedy

from tandem.engine.engine_core import EngineCore
from tandem.engine.spec.eagle import FIRST_POSITION, HIDDEN_STATES
from tandem.sampling_params import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]

MAX_TOKENS = 16


def prompts_of(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def disaggregated(
    prefill: WorkerProcess, decode: WorkerProcess, prompts: list[list[int]], channel: str
) -> list[list[int]]:
    """All prompts through P ("p") -> D ("d") at once over `channel`; checks each request's KV
    arrived intact and returns the decoded tokens."""
    rids = [f"{channel}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts, strict=True):
        ticket = decode.call("reserve", "d", rid, prompt, MAX_TOKENS)
        prefill.call("submit", "p", rid, prompt, MAX_TOKENS, ticket)
    outputs = []
    for rid in rids:
        result = prefill.call("prefill_result", rid)
        tokens, reason = decode.call("tokens", rid, within=20.0)
        assert reason == "length"
        assert tokens[0] == result["first_token"]  # D continues from P's first token
        assert result["data_plane"] == channel
        sent, received = prefill.call("sent", "p", rid), decode.call("received", "d", rid)
        assert len(sent) == len(received)
        for layer, (a, b) in enumerate(zip(sent, received, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{rid}: layer {layer} differs"
        outputs.append(tokens)
    prefill.call("wait_idle", "p")
    decode.call("wait_idle", "d")
    return outputs


@pytest.mark.parametrize("channel", ["pair", "grpc", "shm"])
def test_tiny_model_kv_and_greedy_tokens(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    model = str(tiny_llama_path)
    # Block sizes differ on purpose: 16 and 32 tokens end a block on both sides, 37 on neither.
    prefill_proc.call("prefill_worker", "p", model, channel, num_blocks=64, block_size=16)
    decode_proc.call("decode_worker", "d", model, num_blocks=64, block_size=8)
    prompts = prompts_of([5, 16, 32, 37], vocab=256)
    got = disaggregated(prefill_proc, decode_proc, prompts, channel)
    assert got == decode_proc.call("colocated", model, prompts, MAX_TOKENS)


def test_n_choices_are_prefilled_and_sent_once(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess
) -> None:
    """n = 3: P computes the prompt and samples the three first tokens once, one transfer carries
    them; D holds the prompt's full blocks once (and a copy of the partial one per choice); each
    choice equals a request of its own seeded seed + i; nothing is left on either side."""
    model = str(tiny_llama_path)
    prefill_proc.call("prefill_worker", "p", model, "grpc", num_blocks=64, block_size=8)
    decode_proc.call("decode_worker", "d", model, num_blocks=64, block_size=8)
    prompt = prompts_of([21], vocab=256)[0]  # 2 full blocks of 8 and a partial one
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=5, ignore_eos=True, n=3)
    ticket = decode_proc.call("reserve", "d", "r", prompt, MAX_TOKENS, params=params)
    prefill_proc.call("submit", "p", "r", prompt, MAX_TOKENS, ticket, params=params)
    result = prefill_proc.call("prefill_result", "r")
    choices = decode_proc.call("choices", "r", within=20.0)
    assert [reason for _, reason in choices] == ["length"] * 3
    assert choices[0][0][0] == result["first_token"]
    assert decode_proc.call("used_on_arrival", "d", "r") == 2 + 3
    assert len(prefill_proc.call("sent", "p", "r")) == 2  # one transfer: the model's 2 layers
    want = decode_proc.call("colocated_choices", model, prompt, params)
    assert [tokens for tokens, _ in choices] == want
    assert len({tuple(w) for w in want}) > 1
    prefill_proc.call("wait_idle", "p")
    decode_proc.call("wait_idle", "d")

    # A prefill worker that samples choice 0's first token only (one older than n on the wire):
    # the decode worker computes the prompt itself, with the same choices.
    ticket = decode_proc.call("reserve", "d", "r1", prompt, MAX_TOKENS, params=params)
    one = replace(params, n=1)
    prefill_proc.call("submit", "p", "r1", prompt, MAX_TOKENS, ticket, params=one)
    prefill_proc.call("prefill_result", "r1")
    assert [tokens for tokens, _ in decode_proc.call("choices", "r1", within=20.0)] == want
    prefill_proc.call("wait_idle", "p")
    decode_proc.call("wait_idle", "d")

    # Cancelled while its KV is awaited: every choice ends, the reservation is freed.
    decode_proc.call("reserve", "d", "r2", prompt, MAX_TOKENS, params=params)
    decode_proc.call("cancel", "d", "r2")
    assert decode_proc.call("choices", "r2") == [([], "abort")] * 3
    decode_proc.call("wait_idle", "d")


def test_smollm2_greedy_tokens_on_every_plane(
    smollm2_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess
) -> None:
    model = str(smollm2_path)
    prompts = [[1, *range(100, 100 + n)] for n in (6, 40)]
    # A load takes seconds: both sides load at once, and the two workers serve every plane
    # (the prefill worker gets a new sender per plane).
    with ThreadPoolExecutor(2) as pool:
        loads = [
            pool.submit(prefill_proc.call, "prefill_worker", "p", model, num_blocks=32),
            pool.submit(decode_proc.call, "decode_worker", "d", model, num_blocks=32),
        ]
        for load in loads:
            load.result()
    want = decode_proc.call("colocated", model, prompts, MAX_TOKENS)
    for channel in ("pair", "grpc", "shm"):
        prefill_proc.call("use_sender", "p", channel)
        assert disaggregated(prefill_proc, decode_proc, prompts, channel) == want, channel


def test_eagle_hidden_states_move_with_the_kv(
    tiny_llama_path: Path,
    tiny_eagle_path: Path,
    prefill_proc: WorkerProcess,
    decode_proc: WorkerProcess,
) -> None:
    """With them, the decode worker drafts and accepts exactly as a colocated engine does."""
    model = str(tiny_llama_path)
    spec = {"method": "eagle", "path": str(tiny_eagle_path), "num_speculative_tokens": 3}
    spec["cost_aware"] = False  # draft counts that do not follow the machine's step times
    prefill_proc.call("prefill_worker", "p", model, "grpc", num_blocks=64, speculative=spec)
    decode_proc.call("decode_worker", "d", model, num_blocks=64, speculative=spec)
    prompts = prompts_of([40], vocab=256)  # one: the batch size sets how many drafts
    got = disaggregated(prefill_proc, decode_proc, prompts, "grpc")
    assert decode_proc.call("extras", "d", "grpc-0") == {
        HIDDEN_STATES: (40, 64),  # the prompt's positions x the tiny model's hidden size
        FIRST_POSITION: (1,),
    }
    colocated = EngineCore(engine_config(model, speculative=spec, num_blocks=64))
    req = colocated.add_request("r", prompts[0], greedy(MAX_TOKENS))
    while colocated.has_unfinished():
        colocated.step()
    assert got == [req.output_token_ids]
    stats = colocated.scheduler.spec_stats
    counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert decode_proc.call("spec_counts", "d") == counts
    assert counts[1] > 0
