"""SmolLM2, 1 prefill + 2 decode workers (one with n-gram speculative decoding), end to end.

- Parity: greedy output through the router's gRPC and HTTP APIs (and the official `openai`
  client) equals the offline engine's, for prompts the prefill worker computes and whose KV
  travels to a decode worker, with and without speculative decoding.
- Conditional disaggregation: a short prompt skips the prefill worker.
- Cancellation: a client that closes its SSE connection, or cancels its gRPC call, frees the
  request's KV blocks on both workers within a second.
- Errors: bad input gets the documented error naming the field over both APIs, before any worker
  is involved; overload gets 429 / RESOURCE_EXHAUSTED with a retry hint; a router without workers
  answers 503 / UNAVAILABLE; the workers keep serving afterwards.

One cluster for the module (`smol`, conftest); the tests leave it idle for the next one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
from cluster_helpers import (
    RPC_TIMEOUT_S,
    SMOL,
    generate_request,
    grpc_error,
    grpc_generate,
    grpc_stream,
    http_post,
    scrape,
    sse_events,
    wait_router_idle,
    wait_workers_idle,
    worker_stats,
    workers,
)

from router.router_server import RouterServer
from tandem.cluster.local_cluster import LocalCluster
from tandem.config import RouterConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.llm import RequestOutput
from tandem.registry import Registry
from tandem.v1 import api_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# -- parity ----------------------------------------------------------------------------------

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
PROMPT = (
    "The Roman Empire was one of the largest empires of the ancient world. At its height it "
    "stretched from Britain to Egypt, and its roads, laws and language shaped Europe for "
    "centuries. Historians still argue about why it fell. The most important reason was"
)
CHAT = [
    {"role": "user", "content": "Give me three tips for staying healthy while working from home."}
]


@pytest.fixture(scope="module")
def ref_prompt(smol_llm: LLM) -> RequestOutput:
    return smol_llm.generate(PROMPT, GREEDY)[0]


@pytest.fixture(scope="module")
def ref_chat(smol_llm: LLM) -> RequestOutput:
    return smol_llm.chat(CHAT, GREEDY)[0]


def test_grpc_greedy_equals_offline_with_and_without_speculation(
    smol: LocalCluster, ref_prompt: RequestOutput, ref_chat: RequestOutput
) -> None:
    assert smol.address is not None
    target = smol.address.grpc_target
    (prefill,) = workers(smol, "prefill")
    # Above the router's local_prefill_tokens (32): the prefill worker computes them.
    assert len(ref_prompt.prompt_token_ids) > 32 and len(ref_chat.prompt_token_ids) > 32
    decode_ids = {w.worker_id for w in workers(smol, "decode")}
    seen: dict[str, list[Any]] = {}
    for ref, kwargs in (
        (ref_prompt, {"prompt": PROMPT}),
        (ref_prompt, {"ids": ref_prompt.prompt_token_ids}),
        (ref_chat, {"chat": CHAT}),
        (ref_chat, {"chat": CHAT}),
    ):
        # Consecutive requests alternate over the two decode workers (round robin).
        tokens, last = grpc_generate(target, max_tokens=MAX_TOKENS, temperature=0.0, **kwargs)
        assert tokens == ref.token_ids, f"via {last.timings.decode_worker}"
        assert last.finish_reason == ref.finish_reason
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == len(ref.token_ids)
        assert last.timings.prefill_worker == prefill.worker_id
        assert last.timings.decode_worker in decode_ids
        seen.setdefault(last.timings.decode_worker, []).append(last.timings)
    assert set(seen) == decode_ids, "both decode workers (plain and speculative) served"
    drafting = [w for w, ts in seen.items() if any(t.draft_tokens for t in ts)]
    assert len(drafting) == 1, f"exactly the speculative worker drafts: {seen}"
    assert sum(t.accepted_tokens for t in seen[drafting[0]]) > 0, "drafts were accepted"
    # A request can opt out of speculation, on either worker.
    for _ in range(2):
        tokens, last = grpc_generate(
            target, PROMPT, speculative=False, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert tokens == ref_prompt.token_ids
        assert last.timings.draft_tokens == 0


def test_http_greedy_equals_offline(
    smol: LocalCluster, ref_prompt: RequestOutput, ref_chat: RequestOutput
) -> None:
    assert smol.address is not None
    url = smol.address.http_url
    for _ in range(2):  # once on each decode worker
        r = http_post(
            f"{url}/v1/completions",
            {"model": SMOL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == ref_prompt.text
        assert body["choices"][0]["finish_reason"] == ref_prompt.finish_reason
        assert body["usage"]["completion_tokens"] == len(ref_prompt.token_ids)
    for _ in range(2):
        r = http_post(
            f"{url}/v1/chat/completions",
            {"model": SMOL, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": ref_chat.text}
        assert body["usage"]["prompt_tokens"] == len(ref_chat.prompt_token_ids)


def test_openai_client(
    smol: LocalCluster, ref_prompt: RequestOutput, ref_chat: RequestOutput
) -> None:
    assert smol.address is not None
    client = openai.OpenAI(
        base_url=smol.address.http_url + "/v1", api_key="x", timeout=60.0, max_retries=0
    )
    assert [m.id for m in client.models.list()] == [SMOL]
    sampling: dict[str, Any] = {"model": SMOL, "max_tokens": MAX_TOKENS, "temperature": 0}

    completion = client.completions.create(prompt=PROMPT, **sampling)
    assert completion.choices[0].text == ref_prompt.text
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **sampling))
    assert "".join(c.choices[0].text for c in chunks) == ref_prompt.text
    assert chunks[-1].choices[0].finish_reason == ref_prompt.finish_reason

    chat = client.chat.completions.create(messages=CHAT, **sampling)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == ref_chat.text
    stream = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **sampling,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_chat.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref_chat.token_ids)


# A router replica runs without torch: the script runs in a fresh interpreter whose
# $TANDEM_HOME holds the model but no tokenizer export (the cold path rebuilds it from the GGUF).
ROUTER_ALONE = """
import json, sys, urllib.request
from tandem.config import RouterConfig
from router.router_server import RouterServer

server = RouterServer(RouterConfig(sys.argv[1]), sys.argv[2], "127.0.0.1", 0, 0)
address = server.start()
body = json.dumps({"model": sys.argv[1], "messages": json.loads(sys.argv[3]),
                   "max_tokens": int(sys.argv[4]), "temperature": 0.0}).encode()
request = urllib.request.Request(address.http_url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as response:
    answer = json.loads(response.read())
server.stop()
loaded = {m.split(".")[0] for m in sys.modules} & {"torch", "transformers"}
print(json.dumps({"text": answer["choices"][0]["message"]["content"], "loaded": sorted(loaded)}))
"""


def test_a_router_in_a_fresh_interpreter_serves_chat_without_torch(
    smol: LocalCluster, ref_chat: RequestOutput, smollm2_path: Path, tmp_path: Path
) -> None:
    assert smol.registry is not None
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / smollm2_path.name).symlink_to(smollm2_path)
    args = [SMOL, smol.registry.url, json.dumps(CHAT), str(MAX_TOKENS)]
    run = subprocess.run(
        [sys.executable, "-c", ROUTER_ALONE, *args],
        env={**os.environ, "TANDEM_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result = json.loads(run.stdout.splitlines()[-1])
    assert result == {"text": ref_chat.text, "loaded": []}
    assert len(list((home / "tokenizers").iterdir())) == 1  # the export the cold path made


def test_short_prompt_skips_the_prefill_worker(smol: LocalCluster, smol_llm: LLM) -> None:
    """Conditional disaggregation: a prompt of <= 32 tokens is prefilled by the decode worker."""
    assert smol.address is not None
    (prefill,) = workers(smol, "prefill")
    wait_workers_idle(workers(smol), 5.0)
    before = scrape(prefill.metrics_url)
    ids = smol_llm.encode("Hello! How are you today?")
    assert len(ids) <= 32
    ref = smol_llm.generate(ids, GREEDY)[0]
    for _ in range(2):  # once on each decode worker
        tokens, last = grpc_generate(
            smol.address.grpc_target, ids=ids, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert last.timings.prefill_worker == ""
        assert tokens == ref.token_ids
    after = scrape(prefill.metrics_url)
    for name in ("tandem_prefix_cache_query_tokens", "tandem_requests_running"):
        assert after[name] == before[name], f"{name}: the prefill worker saw the request"


# -- cancellation --------------------------------------------------------------------------

# Long enough for the prefill worker (> 32 tokens); the output (ignore_eos) outlasts the test.
STORY = (
    "Write a very long story about a lighthouse keeper who lives alone on a rocky island in the "
    "north sea, and who one stormy night finds a message in a bottle washed up on the shore."
)
LONG = {"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}


def assert_running_somewhere(cluster: LocalCluster) -> None:
    running = [worker_stats(w).running for w in workers(cluster, "decode")]
    assert sum(running) == 1, f"the request runs on one decode worker: {running}"


def test_closing_the_sse_stream_frees_the_request(smol: LocalCluster) -> None:
    assert smol.address is not None
    all_workers = workers(smol)
    wait_workers_idle(all_workers, 5.0)
    body = {"model": SMOL, "prompt": STORY, "stream": True, **LONG}
    with (
        httpx.Client(timeout=RPC_TIMEOUT_S) as client,
        client.stream("POST", f"{smol.address.http_url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
        for _ in range(3):
            event = next(events)
            assert event["choices"][0]["finish_reason"] is None
        assert_running_somewhere(smol)
    # The connection is closed: the router cancels both calls, the workers free the blocks.
    wait_workers_idle(all_workers, 1.0)
    wait_router_idle(smol)


def test_cancelling_the_grpc_call_frees_the_request(smol: LocalCluster) -> None:
    assert smol.address is not None
    all_workers = workers(smol)
    wait_workers_idle(all_workers, 5.0)
    with grpc_stream(smol.address.grpc_target, STORY, **LONG) as call:
        for _ in range(3):
            assert not next(call).finish_reason
        assert_running_somewhere(smol)
        call.cancel()
        wait_workers_idle(all_workers, 1.0)
    wait_router_idle(smol)


# -- errors --------------------------------------------------------------------------------

MAX_MODEL_LEN = 8192  # SmolLM2's context

# (case, HTTP body fields, gRPC Generate kwargs, the field the error names)
BAD_INPUT: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    ("empty prompt", {"prompt": ""}, {"prompt": ""}, ("prompt",)),
    (
        "too long",
        {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN},
        {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN},
        ("prompt", "max_tokens"),
    ),
    ("negative temperature", {"temperature": -1}, {"temperature": -1.0}, ("temperature",)),
    ("top_p 0", {"top_p": 0}, {"top_p": 0.0}, ("top_p",)),
    ("max_tokens 0", {"max_tokens": 0}, {"max_tokens": 0}, ("max_tokens",)),
]


@pytest.mark.parametrize(
    ("body", "field"), [(b, f) for _, b, _, f in BAD_INPUT], ids=[c for c, *_ in BAD_INPUT]
)
def test_http_bad_input_is_400_naming_the_field(
    smol: LocalCluster, body: dict[str, Any], field: tuple[str, ...]
) -> None:
    assert smol.address is not None
    url = smol.address.http_url
    r = http_post(f"{url}/v1/completions", {"model": SMOL, "prompt": "Hello", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] in field, error
    if body.get("prompt") != "":  # the same fields on the chat route
        fields = {k: v for k, v in body.items() if k != "prompt"}
        chat = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], **fields}
        r = http_post(f"{url}/v1/chat/completions", chat)
        assert r.status_code == 400, r.text
        chat_fields = tuple("messages" if f == "prompt" else f for f in field)
        assert r.json()["error"]["param"] in chat_fields  # chat requests have no "prompt"


@pytest.mark.parametrize(
    ("kwargs", "field"), [(k, f) for _, _, k, f in BAD_INPUT], ids=[c for c, *_ in BAD_INPUT]
)
def test_grpc_bad_input_is_invalid_argument_naming_the_field(
    smol: LocalCluster, kwargs: dict[str, Any], field: tuple[str, ...]
) -> None:
    assert smol.address is not None
    kwargs = {"prompt": "Hello", **kwargs}
    e = grpc_error(smol.address.grpc_target, **kwargs)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert any(f in e.details() for f in field), e.details()


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**31), ("timeout", float("nan"))],  # past the wire's int32; JSON's NaN token
)
def test_http_out_of_wire_range_or_nan_values_are_400(
    smol: LocalCluster, field: str, value: float
) -> None:
    """Found by fuzzing: top_k 2**31 was a 500 (the worker request's int32 overflowed), a NaN
    timeout a 504 (a NaN deadline)."""
    assert smol.address is not None
    url = smol.address.http_url
    hi = {"messages": [{"role": "user", "content": "Hi"}]}
    for route, prompt in (("completions", {"prompt": "Hello"}), ("chat/completions", hi)):
        body = {"model": SMOL, "max_tokens": 2, field: value, **prompt}
        r = http_post(f"{url}/v1/{route}", raw=json.dumps(body).encode())  # NaN as JSON's NaN
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_grpc_nan_timeout_is_invalid_argument(smol: LocalCluster) -> None:
    assert smol.address is not None
    request = generate_request("Hello", max_tokens=2)
    request.timeout_s = float("nan")
    with (
        grpc.insecure_channel(smol.address.grpc_target) as channel,
        pytest.raises(grpc.RpcError) as error,
    ):
        list(api_pb2_grpc.TandemStub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout" in (error.value.details() or "")


def test_a_64_bit_seed_is_served(smol: LocalCluster) -> None:
    """A seed in [2**63, 2**64) travels as seed - 2**64, the wire's int64, with the same draws
    (tests/unit/test_messages.py); it was a 500."""
    assert smol.address is not None
    for seed in (2**63, 2**64 - 1):
        body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 4, "seed": seed}
        r = http_post(f"{smol.address.http_url}/v1/completions", body)
        assert r.status_code == 200, r.text


def test_malformed_json_is_400(smol: LocalCluster) -> None:
    assert smol.address is not None
    for route in ("completions", "chat/completions"):
        r = http_post(f"{smol.address.http_url}/v1/{route}", raw=b'{"prompt": "Hi", ')
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "body"
    # Well-formed JSON of the wrong shape names the field.
    r = http_post(f"{smol.address.http_url}/v1/chat/completions", {"messages": "Hi"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"


def test_unknown_model_is_not_found(smol: LocalCluster) -> None:
    assert smol.address is not None
    r = http_post(f"{smol.address.http_url}/v1/completions", {"model": "nope", "prompt": "Hi"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "model"
    e = grpc_error(smol.address.grpc_target, "Hi", model="nope")
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert "model" in e.details()


@pytest.fixture(scope="module")
def capped_router(smol: LocalCluster) -> Iterator[RouterServer]:
    """A second router on the same workers that dispatches one request at a time, no queue."""
    assert smol.registry is not None
    server = RouterServer(
        RouterConfig(SMOL, max_inflight=1, max_queue=0), smol.registry.url, http_port=0, grpc_port=0
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_overload_is_429_and_resource_exhausted(
    smol: LocalCluster, capped_router: RouterServer
) -> None:
    address = capped_router.address
    assert address is not None
    long = {"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
    with grpc_stream(address.grpc_target, "Tell me a story.", **long) as call:
        next(call)  # the one dispatch slot is taken
        r = http_post(f"{address.http_url}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        e = grpc_error(address.grpc_target, "Hi", max_tokens=2)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(e.trailing_metadata())["retry-after"]) >= 1
    # The slot is free again once the long request is cancelled.
    wait_workers_idle(workers(smol), 2.0)
    tokens, last = grpc_generate(address.grpc_target, "Hi", max_tokens=2, temperature=0.0)
    assert len(tokens) == last.usage.completion_tokens > 0


def test_no_worker_is_503_and_unavailable(smollm2_path: Path) -> None:
    registry = Registry()  # an empty registry: no worker ever registers
    config = RouterConfig(SMOL, decode_wait_s=0.0)  # no waiting for a replacement
    server = RouterServer(config, registry.url, http_port=0, grpc_port=0)
    try:
        address = server.start()
        r = http_post(f"{address.http_url}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        e = grpc_error(address.grpc_target, "Hi", max_tokens=2)
        assert e.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()
        registry.close()


def test_workers_serve_normally_afterwards(smol: LocalCluster) -> None:
    assert smol.address is not None
    wait_workers_idle(workers(smol), 2.0)
    for _ in range(2):  # both decode workers
        tokens, last = grpc_generate(
            smol.address.grpc_target, "Hello!", max_tokens=4, temperature=0.0
        )
        assert last.finish_reason in ("stop", "length") and tokens
    r = http_post(f"{smol.address.http_url}/v1/completions", {"prompt": "Hello!", "max_tokens": 4})
    assert r.status_code == 200, r.text
    wait_workers_idle(workers(smol), 2.0)
    wait_router_idle(smol)
