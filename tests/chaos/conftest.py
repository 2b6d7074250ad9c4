"""Fixtures of the chaos suite: a local --no-ray cluster on the tiny random Llama (real worker
processes on loopback, the embedded Redis, the router in this process) and the offline engine's
greedy outputs, which every completed request must equal.

`make test` runs one scenario of each fault class; the scenarios marked `chaos` (deselected by
default) run with the rest under `make chaos`. The helpers of the cluster tests are reused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster"))

from chaos_load import MAX_TOKENS, PROMPTS, prompt_ids
from cluster_helpers import grpc_stream

from tandem.cluster.local_cluster import LocalCluster
from tandem.engine import LLM
from tandem.sampling_params import SamplingParams

WORKER_ARGS = ["--kv-memory-gib", "0.05", "--num-threads", "1"]
TTL_S = 1.5  # a killed worker leaves the registry this long after its last heartbeat

Reference = dict[int, tuple[list[int], str]]


@pytest.fixture(scope="session")
def offline_tokens(tiny_llama_path: Path) -> dict[int, list[int]]:
    """The offline engine's greedy tokens for each load prompt."""
    llm = LLM(str(tiny_llama_path), dtype="float32", memory_gib=0.05)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([prompt_ids(i) for i in range(PROMPTS)], params)
    return {i: list(out.token_ids) for i, out in enumerate(outputs)}


def reference_of(cluster: LocalCluster, offline: dict[int, list[int]]) -> Reference:
    """Each prompt's greedy tokens and the text the router makes of them, from one request on
    the undisturbed cluster, whose tokens must equal the offline engine's."""
    assert cluster.address is not None
    reference: Reference = {}
    for i, tokens in offline.items():
        got: list[int] = []
        text = ""
        with grpc_stream(
            cluster.address.grpc_target, ids=prompt_ids(i), max_tokens=MAX_TOKENS,
            temperature=0.0, ignore_eos=True,
        ) as call:  # fmt: skip
            for msg in call:
                got.extend(msg.token_ids)
                text += msg.text
        assert got == tokens, f"prompt {i}: the cluster's greedy output is not the offline one"
        reference[i] = (tokens, text)
    return reference
