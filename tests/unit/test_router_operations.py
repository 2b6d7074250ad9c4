"""The router's operations surface, against a real router (HTTP and gRPC on loopback) over an
embedded registry, with a scripted decode worker where a request has to be served:

- the API key (`--api-key`, else $TANDEM_API_KEY): the official `openai` client and gRPC calls
  with the right key are served; a wrong or missing key is 401 (OpenAI's error body) /
  UNAUTHENTICATED; the probes, /metrics, /version and gRPC health stay open; the admin APIs
  take the admin token, not the API key;
- /tokenize, /detokenize (vLLM's bodies), /version, and the context length in /v1/models and
  ListModels; bad input is 400 naming the field;
- readiness: gRPC health of the server and of `tandem.v1.Tandem` is NOT_SERVING, and /ready 503,
  while no decode worker can take requests (none registered, or only a draining one), and turns
  SERVING / 200 when one registers, as heard on a health Watch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.router_server import RouterAddress, RouterServer
from router.tools import hermes_messages
from tandem.cli.cluster_cli import router_config
from tandem.config import RouterConfig
from tandem.registry import Registry, WorkerRecord
from tandem.tokenizer import load_tokenizer
from tandem.v1 import api_pb2, api_pb2_grpc, kv_transfer_pb2, worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # slow: SmolLM2's tokenizer

SMOL = "smollm2-135m"
API_KEY = "sk-test-key"
ADMIN_TOKEN = "admin-token"
ANSWER = "Hello"  # what the scripted decode worker says, one token
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TANDEM = "tandem.v1.Tandem"


class OneTokenDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker that prefills locally and answers every request with one token."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id
        self.request_ids: list[str] = []

    def Decode(self, request: Any, context: Any) -> Iterator[worker_pb2.DecodeResponse]:
        key = request.request.request_id
        self.request_ids.append(key)
        yield worker_pb2.DecodeResponse(ticket=kv_transfer_pb2.KVTicket(request_key=key))
        chunk = worker_pb2.TokenChunk(token_ids=[self.token_id], finish_reason="stop")
        yield worker_pb2.DecodeResponse(tokens=chunk)


def decode_record(worker_id: str, endpoint: str = "127.0.0.1:1") -> WorkerRecord:
    now = time.time()
    return WorkerRecord(
        worker_id, "decode", SMOL, endpoint, "", "", 100, 100, 0, 0, False, (), now, now
    )


@pytest.fixture(scope="module")
def keyed(smollm2_path: Path) -> Iterator[RouterAddress]:
    """A router with an API key and an admin token, over one scripted decode worker."""
    with one_token_router(smollm2_path, RouterConfig(SMOL, api_key=API_KEY)) as (address, _):
        yield address


@contextlib.contextmanager
def one_token_router(
    path: Path, config: RouterConfig
) -> Iterator[tuple[RouterAddress, OneTokenDecode]]:
    """A router (with the admin token) over one scripted decode worker, and that worker."""
    [token_id] = load_tokenizer(path).encode(ANSWER)
    decode = OneTokenDecode(token_id)
    worker = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, worker)
    port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    with Registry() as registry:
        registry.register(decode_record("d1", f"127.0.0.1:{port}"), ttl_s=300)
        server = RouterServer(
            config, registry.url, http_port=0, grpc_port=0, admin_token=ADMIN_TOKEN
        )
        try:
            yield server.start(), decode
        finally:
            server.stop()
            worker.stop(None)


def test_an_http_response_id_is_the_request_id_the_workers_see(smollm2_path: Path) -> None:
    """So that a client's request can be found in the router's and the workers' logs: chat,
    completions, and completions of several prompts (the response's id, then -i for each)."""
    with one_token_router(smollm2_path, RouterConfig(SMOL)) as (address, decode):
        openai_client = client(address, "none")
        chat = openai_client.chat.completions.create(model=SMOL, messages=CHAT)
        one = openai_client.completions.create(model=SMOL, prompt="Hi", max_tokens=1)
        two = openai_client.completions.create(model=SMOL, prompt=["Hi", "Yo"], max_tokens=1)
        assert chat.id.startswith("chatcmpl-") and one.id.startswith("cmpl-")
        assert decode.request_ids[:2] == [chat.id, one.id]
        assert sorted(decode.request_ids[2:]) == [f"{two.id}-0", f"{two.id}-1"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(address: RouterAddress, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=address.http_url + "/v1", api_key=key, timeout=30.0, max_retries=0
    )


CHAT: list[Any] = [{"role": "user", "content": "Hi"}]

# -- the API key -----------------------------------------------------------------------------


def test_the_openai_client_needs_the_api_key(keyed: RouterAddress) -> None:
    answer = client(keyed, API_KEY).chat.completions.create(model=SMOL, messages=CHAT)
    assert answer.choices[0].message.content == ANSWER
    wrong = client(keyed, "wrong")  # it sends nothing without a key: httpx tests that below
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=SMOL, messages=CHAT)
    assert e.value.status_code == 401
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_every_route_but_the_probes_needs_the_api_key(keyed: RouterAddress) -> None:
    url = keyed.http_url
    calls = [
        ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "Hi"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/docs", None),  # deny by default: a route not named open needs the key
    ]
    for method, path, body in calls:
        r = httpx.request(method, url + path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        assert "API key required" in r.json()["error"]["message"]
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path
    r = httpx.post(url + "/tokenize", json={"prompt": "Hi"}, headers=bearer(API_KEY))
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/tokenize", json={"prompt": "Hi"}, headers={"Authorization": API_KEY})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"


def test_the_admin_api_takes_the_admin_token_not_the_api_key(keyed: RouterAddress) -> None:
    workers = keyed.http_url + "/admin/workers"
    r = httpx.get(workers, headers=bearer(API_KEY))
    assert r.status_code == 401 and "admin token" in r.json()["error"]["message"]
    r = httpx.get(workers, headers=bearer(ADMIN_TOKEN))
    assert r.status_code == 200 and [w["worker_id"] for w in r.json()["workers"]] == ["d1"]


def test_grpc_needs_the_api_key_on_tandem_only(keyed: RouterAddress) -> None:
    request = api_pb2.GenerateRequest(prompt="Hi", sampling=api_pb2.SamplingOptions(max_tokens=1))
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        tandem = api_pb2_grpc.TandemStub(channel)
        good = (("authorization", f"Bearer {API_KEY}"),)
        [reply] = tandem.Generate(request, metadata=good, timeout=30)
        assert reply.text == ANSWER and reply.finish_reason == "stop"
        assert tandem.ListModels(api_pb2.ListModelsRequest(), metadata=good, timeout=5).models
        for metadata in ((("authorization", "Bearer wrong"),), ()):
            with pytest.raises(grpc.RpcError) as e:
                list(tandem.Generate(request, metadata=metadata, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                tandem.ListModels(api_pb2.ListModelsRequest(), metadata=metadata, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        check = health_pb2_grpc.HealthStub(channel).Check  # open: probes send no key
        assert check(health_pb2.HealthCheckRequest(service=TANDEM), timeout=5).status == SERVING


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert router_config(SMOL, None).api_key == "from-env"
    assert router_config(SMOL, "from-flag").api_key == "from-flag"
    monkeypatch.setenv("TANDEM_API_KEY", "")
    assert router_config(SMOL, None).api_key is None  # set but empty: open, as unset
    assert "from-flag" not in repr(router_config(SMOL, "from-flag"))  # logs do not leak it


# -- /tokenize, /detokenize, /version, the context length ---------------------------------------


def post(address: RouterAddress, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(address.http_url + path, json=body, headers=bearer(API_KEY), timeout=30)


def test_tokenize_and_detokenize_round_trip(keyed: RouterAddress, smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    models = httpx.get(keyed.http_url + "/v1/models", headers=bearer(API_KEY)).json()["data"]
    max_model_len = models[0]["max_model_len"]
    assert max_model_len > 0
    text = "The capital of France is"
    r = post(keyed, "/tokenize", {"model": SMOL, "prompt": text})
    assert r.json() == {
        "tokens": tokenizer.encode(text),
        "count": len(tokenizer.encode(text)),
        "max_model_len": max_model_len,
    }
    assert post(keyed, "/detokenize", {"tokens": r.json()["tokens"]}).json() == {"prompt": text}

    chat = [{"role": "user", "content": text}]
    opened = post(keyed, "/tokenize", {"messages": chat}).json()
    bare = post(keyed, "/tokenize", {"messages": chat, "add_generation_prompt": False}).json()
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert opened["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert opened["tokens"][: bare["count"]] == bare["tokens"] and opened["count"] > bare["count"]
    parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    assert post(keyed, "/tokenize", {"messages": parts}).json() == opened  # as chat reads them

    # Tools reach the chat template as a chat request's do (SmolLM2's renders none: Hermes's way)
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time"}}]
    offered = post(keyed, "/tokenize", {"messages": chat, "tools": tools}).json()["tokens"]
    function = {**tools[0]["function"], "parameters": {"type": "object", "properties": {}}}
    listed = hermes_messages(chat, [{"type": "function", "function": function}])
    rendered = tokenizer.apply_chat_template(listed, add_generation_prompt=True)
    assert offered == tokenizer.encode(rendered, add_special_tokens=False)
    assert "get_time" in tokenizer.decode(offered)


def test_version_and_the_context_length(keyed: RouterAddress) -> None:
    r = httpx.get(keyed.http_url + "/version")
    assert r.json() == {"version": version("tandem-serve")}
    [card] = httpx.get(keyed.http_url + "/v1/models", headers=bearer(API_KEY)).json()["data"]
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        [model] = (
            api_pb2_grpc.TandemStub(channel)
            .ListModels(
                api_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {API_KEY}"),)
            )
            .models
        )
    assert card["id"] == model.id == SMOL
    assert card["max_model_len"] == model.max_model_len > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "Hi", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "Hi", "tools": [{"type": "function"}]}, 400, "tools"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/tokenize", {"prompt": "Hi", "model": "nope"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1 << 40]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(
    keyed: RouterAddress, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = post(keyed, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- readiness --------------------------------------------------------------------------------


def test_grpc_health_and_ready_follow_the_decode_pool(smollm2_path: Path) -> None:
    with Registry() as registry:
        server = RouterServer(
            RouterConfig(SMOL), registry.url, http_port=0, grpc_port=0, refresh_s=0.05
        )
        address = server.start()
        try:
            with grpc.insecure_channel(address.grpc_target) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                def status(service: str) -> int:
                    request = health_pb2.HealthCheckRequest(service=service)
                    return int(health.Check(request, timeout=5).status)

                def ready() -> int:
                    return httpx.get(address.http_url + "/ready").status_code

                watch = health.Watch(health_pb2.HealthCheckRequest(service=TANDEM), timeout=30)
                assert next(watch).status == NOT_SERVING
                assert (status(""), status(TANDEM), ready()) == (NOT_SERVING, NOT_SERVING, 503)
                assert status("tandem.v1.Admin") == SERVING  # scaling an empty pool needs it

                registry.register(decode_record("d1"), ttl_s=300)
                assert next(watch).status == SERVING
                assert (status(""), ready()) == (SERVING, 200)

                registry.deregister("d1")
                assert next(watch).status == NOT_SERVING
                assert (status(""), ready()) == (NOT_SERVING, 503)

                registry.register(replace(decode_record("d2"), draining=True), ttl_s=300)
                registry.register(decode_record("d3"), ttl_s=300)
                assert next(watch).status == SERVING
                registry.deregister("d3")  # d2 alone drains: it takes no new request
                assert next(watch).status == NOT_SERVING
                assert ready() == 503
                assert httpx.get(address.http_url + "/health").status_code == 200  # liveness
                watch.cancel()
        finally:
            server.stop()
