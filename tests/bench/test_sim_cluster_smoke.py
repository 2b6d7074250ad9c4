"""A sim 1P1D cluster (real registry, router, workers and KV transfer; modelled clock), and
`calibrate` on the tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc

from tandem.bench.calibrate import CalibrateConfig, calibrate
from tandem.bench.sim_cluster import SimCluster
from tandem.engine.sim import SimProfile, prompt_seed, sim_token
from tandem.v1 import api_pb2, api_pb2_grpc


def test_calibrate_on_the_tiny_model(tiny_llama_path: Path) -> None:
    config = CalibrateConfig(
        model=str(tiny_llama_path),
        threads=1,
        prefill_lengths=(16, 64),
        batches=(1, 4),
        contexts=(16, 64),
        decode_steps=3,
    )
    profile = calibrate(config)
    assert len(profile.samples) == 2 + 4
    assert profile.kv_bytes_per_token > 0
    predicted = profile.time_of(64, 0, 0)
    assert 0 < predicted < 5.0
    assert profile.time_of(0, 4, 256) > 0
    assert SimProfile.from_dict(json.loads(profile.to_json())) == profile


def test_sim_1p1d_cluster_answers_deterministically(tiny_llama_path: Path, tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    SimProfile(step_overhead_s=0.001, prefill_s_per_token=1e-5, transfer_bytes_per_s=1e9).save(
        profile
    )
    model = str(tiny_llama_path)
    with SimCluster(model, str(profile), 1, 1, local_prefill_tokens=4) as cluster:
        with grpc.insecure_channel(cluster.grpc_target) as ch:
            stub = api_pb2_grpc.TandemStub(ch)
            for n in (3, 40):  # local prefill on D, then P -> D with a KV transfer
                prompt = [(7 * j) % 200 + 3 for j in range(n)]
                req = api_pb2.GenerateRequest(
                    prompt_token_ids=api_pb2.TokenIds(ids=prompt),
                    sampling=api_pb2.SamplingOptions(max_tokens=5, ignore_eos=True),
                )
                msgs = list(stub.Generate(req, timeout=60))
                tokens = [t for m in msgs for t in m.token_ids]
                seed = prompt_seed(prompt)
                assert tokens == [sim_token(seed, n + i, 256, frozenset({2})) for i in range(5)]
                assert msgs[-1].finish_reason == "length"
                if n == 40:
                    assert msgs[-1].timings.prefill_worker
        assert cluster.registry is not None
        workers = cluster.registry.workers(model=model)
        assert sorted(w.role for w in workers) == ["decode", "prefill"]

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            workers = cluster.registry.workers(model=model)
            if all(w.kv_blocks_free == w.kv_blocks_total for w in workers):
                break
            time.sleep(0.2)
        assert all(w.kv_blocks_free == w.kv_blocks_total for w in workers), workers
