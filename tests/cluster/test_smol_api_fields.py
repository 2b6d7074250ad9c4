"""Every field of OpenAI's request types works, is an accepted no-op, or is a 400 naming it.

The field lists come from the installed `openai` package, so a field OpenAI adds is classified
here the day the package knows it. Structured outputs: JSON schema, JSON object, choice, regex,
over HTTP (the official client) and gRPC, disaggregated and speculative. Also: a missing
max_tokens means the rest of the context, message content as a list of text parts,
`include_stop_str_in_output`, `max_completion_tokens` on completions, and a non-streaming client
that leaves ends its request on both workers. On the module's SmolLM2 cluster (`smol`,
conftest).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_type_hints

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
from cluster_helpers import (
    SMOL,
    generate_request,
    grpc_error,
    grpc_generate,
    http_post,
    scrape,
    sse_events,
    wait_router_idle,
    wait_workers_idle,
    workers,
)
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import BaseModel

from router.http_api import NO_OP_FIELDS, ChatRequest, CompletionRequest
from router.router_server import RouterAddress, RouterServer
from tandem.cluster.local_cluster import LocalCluster
from tandem.config import RouterConfig
from tandem.engine import LLM, SamplingParams
from tandem.structured import StructuredOutput
from tandem.tokenizer import load_tokenizer
from tandem.v1 import api_pb2, api_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = [{"role": "user", "content": "Name three colours."}]
NO_OP_VALUES = {
    "user": "user-1",
    "store": False,
    "metadata": {"team": "search"},
    "service_tier": "auto",
    "prompt_cache_key": "key-1",
    "safety_identifier": "id-1",
}


def openai_fields(params: type) -> set[str]:
    return set(get_type_hints(params, include_extras=False)) | {"stream"}


ENDPOINTS = [
    (
        "/v1/chat/completions",
        openai_fields(chat_create_params.CompletionCreateParamsBase),
        ChatRequest,
        {"model": SMOL, "messages": CHAT, "max_tokens": 1},
    ),
    (
        "/v1/completions",
        openai_fields(completion_create_params.CompletionCreateParamsBase),
        CompletionRequest,
        {"model": SMOL, "prompt": "Hello", "max_tokens": 1},
    ),
]


@pytest.fixture(scope="module")
def url(smol: LocalCluster) -> str:
    assert smol.address is not None
    return smol.address.http_url


def test_the_no_op_fields_are_known_to_openai() -> None:
    known = set.union(*(fields for _, fields, _, _ in ENDPOINTS))
    assert set(NO_OP_FIELDS) <= known
    assert set(NO_OP_VALUES) == set(NO_OP_FIELDS)


@pytest.mark.parametrize(("path", "fields", "model", "base"), ENDPOINTS, ids=["chat", "completion"])
def test_every_openai_field_works_is_a_no_op_or_is_rejected_by_name(
    url: str, path: str, fields: set[str], model: type, base: dict[str, Any]
) -> None:
    served = set(model.model_fields) - set(NO_OP_FIELDS)
    rejected = sorted(fields - served - set(NO_OP_FIELDS))
    assert "functions" in rejected or path == "/v1/completions"
    for name in rejected:
        r = http_post(f"{url}{path}", {**base, name: {"any": "value"}})
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == name and "not supported" in error["message"], error
    for name in sorted(fields & set(NO_OP_FIELDS)):
        r = http_post(f"{url}{path}", {**base, name: NO_OP_VALUES[name]})
        assert r.status_code == 200, (name, r.text)


def test_a_field_openai_does_not_know_is_rejected_by_name(url: str) -> None:
    r = http_post(
        f"{url}/v1/chat/completions",
        {"model": SMOL, "messages": CHAT, "guided_decoding_backend": "xgrammar"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "guided_decoding_backend"


def test_a_prompt_too_long_for_any_tokens_is_refused_unencoded(
    smol: LocalCluster, url: str
) -> None:
    """Megabytes of prompt: 400 / INVALID_ARGUMENT naming the field, told from the characters
    alone (encoding 2 MB would take the router seconds), over completions, chat, /tokenize and
    gRPC."""
    huge = "All work and no play makes Jack a dull boy. " * ((2 << 20) // 44)
    for path, body, field in [
        ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/tokenize", {"prompt": huge}, "prompt"),
    ]:
        r = http_post(f"{url}{path}", {"model": SMOL} | body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "characters, more than max_model_len" in error["message"]
    assert smol.address is not None
    e = grpc_error(smol.address.grpc_target, huge, max_tokens=1)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt has" in (e.details() or "") and "characters" in (e.details() or "")


@pytest.fixture(scope="module")
def short_context_router(smol: LocalCluster) -> Iterator[RouterAddress]:
    """A second router over the same workers that allows 48 tokens of context."""
    assert smol.registry is not None
    server = RouterServer(
        RouterConfig(SMOL, max_model_len=48), smol.registry.url, http_port=0, grpc_port=0
    )
    try:
        yield server.start()
    finally:
        server.stop()


def test_without_max_tokens_a_request_runs_to_eos_or_the_context_end(
    short_context_router: RouterAddress,
) -> None:
    """Chat and completions over HTTP, and gRPC: the rest of the (48-token) context."""
    url = short_context_router.http_url
    story = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    for path, body in [
        ("/v1/chat/completions", {"model": SMOL, "messages": story}),
        ("/v1/completions", {"model": SMOL, "prompt": "Once upon a time, a dragon"}),
    ]:
        r = http_post(f"{url}{path}", body | {"temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 48
        assert choice["finish_reason"] == "length"
    target = short_context_router.grpc_target
    _, last = grpc_generate(target, "Once upon a time, a dragon", temperature=0, ignore_eos=True)
    assert last.usage.prompt_tokens + last.usage.completion_tokens == 48
    assert last.finish_reason == "length"


def test_chat_options_reach_the_template_and_the_detokenizer(url: str, smol_llm: LLM) -> None:
    """`max_completion_tokens` on chat, `chat_template_kwargs` (a variable the template reads:
    SmolLM2's default system prompt is only rendered when no system message is given, so a
    kwarg that the template ignores changes nothing, and `add_generation_prompt` false does),
    and `skip_special_tokens` false (a special token shows in the text)."""
    body = {"model": SMOL, "messages": CHAT, "temperature": 0, "max_completion_tokens": 3}
    r = http_post(f"{url}/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    tokens = http_post(f"{url}/tokenize", {"model": SMOL, "messages": CHAT}).json()["count"]
    kwargs = {"chat_template_kwargs": {"unused_variable": 1}}
    r = http_post(f"{url}/v1/chat/completions", body | kwargs)
    assert r.json()["usage"]["prompt_tokens"] == tokens
    r = http_post(f"{url}/v1/chat/completions", body | {"add_generation_prompt": False})
    assert r.json()["usage"]["prompt_tokens"] < tokens
    start = smol_llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(start) == 1  # one special token, which logit_bias makes the only choice
    body |= {"max_completion_tokens": 2, "logit_bias": {str(start[0]): 100}}
    texts = [
        http_post(f"{url}/v1/chat/completions", body | {"skip_special_tokens": skip}).json()
        for skip in (True, False)
    ]
    assert [t["choices"][0]["message"]["content"] for t in texts] == ["", "<|im_start|>" * 2]


def test_no_op_fields_are_logged(url: str, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": SMOL, "prompt": "Hello", "max_tokens": 1, "user": "user-7"}
    with caplog.at_level(logging.INFO, logger="router.http_api"):
        assert http_post(f"{url}/v1/completions", body).status_code == 200
    assert any("user" in r.getMessage() for r in caplog.records if r.name == "router.http_api")


def test_text_parts_are_read_and_other_parts_rejected(url: str, smol_llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    reference = smol_llm.chat(CHAT, greedy)[0].text
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    body = {"model": SMOL, "messages": parts, "max_tokens": 8, "temperature": 0}
    r = http_post(f"{url}/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body["messages"] = [{"role": "user", "content": [image]}]
    r = http_post(f"{url}/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "image_url" in r.text


def test_stop_string_kept_on_request_and_max_completion_tokens(url: str, smol_llm: LLM) -> None:
    prompt = "The capital of France is"
    text = smol_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].text
    stop = text.strip().split()[0]
    body = {"model": SMOL, "prompt": prompt, "temperature": 0, "stop": [stop]}
    kept = http_post(f"{url}/v1/completions", {**body, "include_stop_str_in_output": True})
    dropped = http_post(f"{url}/v1/completions", {**body, "max_completion_tokens": 8})
    assert kept.json()["choices"][0]["text"] == dropped.json()["choices"][0]["text"] + stop
    assert dropped.json()["usage"]["completion_tokens"] <= 8
    zero = http_post(f"{url}/v1/completions", {**body, "max_completion_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_completion_tokens"
    both = {**body, "max_tokens": 4, "max_completion_tokens": 4}
    r = http_post(f"{url}/v1/completions", both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_non_streaming_client_that_leaves_frees_its_blocks(smol: LocalCluster, url: str) -> None:
    every_worker = workers(smol)
    wait_workers_idle(every_worker, 5.0)
    body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    body["n"] = 2  # every choice ends
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the request runs
        httpx.post(f"{url}/v1/completions", json=body, timeout=2.0)
    wait_workers_idle(every_worker, 10.0)
    wait_router_idle(smol, 10.0)


def test_a_client_deadline_ends_the_request_on_every_worker(smol: LocalCluster, url: str) -> None:
    """The client's deadline travels with the request: an HTTP stream given `x-request-timeout`
    ends with a 504 event in the stream (the client still reads), a gRPC call's own deadline
    (`grpc-timeout`) ends it as DEADLINE_EXCEEDED; the workers stop and free every block."""
    every_worker = workers(smol)
    body = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    headers = {"x-request-timeout": "1.5"}
    start = time.monotonic()
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == 504
    assert time.monotonic() - start < 10
    wait_workers_idle(every_worker, 10.0)
    for bad in ("soon", "0"):
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-timeout": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-timeout"
    request = generate_request("Once upon a time", max_tokens=2000, ignore_eos=True)
    assert smol.address is not None
    target = smol.address.grpc_target
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as e:
        list(api_pb2_grpc.TandemStub(channel).Generate(request, timeout=1.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_workers_idle(every_worker, 10.0)
    wait_router_idle(smol, 10.0)


# -- structured outputs ----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
# The example in the prompt gives the n-gram proposer something to draft from.
SCHEMA_CHAT = [
    {
        "role": "user",
        "content": 'Pick a colour and a count, answering like {"colour":"red","count":3}.',
    }
]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused")


def test_json_schema_output_validates_for_20_prompts(client: openai.OpenAI, smol_llm: LLM) -> None:
    """Sampled, 4 at a time: the router spreads them over both decode workers (one speculating)
    and the prefill worker (the chat template makes each prompt long enough); and the same 20
    prompts in one batch of the offline engine."""
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
    }

    def ask(seed: int) -> str:
        r = client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": f"Request {seed}. {SCHEMA_CHAT[0]['content']}"}],
            response_format=response_format,
            max_tokens=30,
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(4) as pool:
        for content in pool.map(ask, range(20)):
            jsonschema.validate(json.loads(content), SCHEMA)
    structured = StructuredOutput.json_schema(SCHEMA, "response_format")
    offline = smol_llm.chat(
        [
            [{"role": "user", "content": f"Request {seed}. {SCHEMA_CHAT[0]['content']}"}]
            for seed in range(20)
        ],
        [
            SamplingParams(max_tokens=30, temperature=1.0, seed=seed, structured_output=structured)
            for seed in range(20)
        ],
    )
    for out in offline:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_regex_and_json_object(client: openai.OpenAI) -> None:
    choices = ["yes", "no", "maybe"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": "Is the sky green?"}],
            max_tokens=5,
            extra_body=extra,
        )
        assert r.choices[0].message.content in choices
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,2}"
    for _ in range(2):
        c = client.completions.create(
            model=SMOL,
            prompt="My birthday is on",
            max_tokens=12,
            extra_body={"guided_regex": regex},
        )
        assert re.fullmatch(regex, c.choices[0].text), c.choices[0].text
    cat = 'Give a JSON object with one key "name" for a cat.'
    r = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": cat}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    r = client.chat.completions.create(
        model=SMOL,
        messages=SCHEMA_CHAT,
        max_tokens=30,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'  # GBNF
    c = client.completions.create(
        model=SMOL, prompt="Is water wet?", max_tokens=10, extra_body={"guided_grammar": grammar}
    )
    assert c.choices[0].text in ("The answer is yes.", "The answer is no."), c.choices[0].text


def test_grpc_structured_output_is_constrained_from_the_prefill_worker_on(
    smol: LocalCluster, smol_llm: LLM
) -> None:
    """The first token is sampled on the prefill worker, the rest on either decode worker (one
    speculating): greedy output equals the offline engine's, token for token."""
    assert smol.address is not None
    structured = StructuredOutput.json_schema(SCHEMA, "structured_output")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, structured_output=structured)
    ref = smol_llm.chat(SCHEMA_CHAT, greedy)[0]
    assert ref.finish_reason == "stop"
    jsonschema.validate(json.loads(ref.text), SCHEMA)
    (prefill,) = workers(smol, "prefill")
    option = api_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    drafted = 0
    for _ in range(2):  # both decode workers
        tokens, last = grpc_generate(
            smol.address.grpc_target,
            chat=SCHEMA_CHAT,
            max_tokens=30,
            temperature=0.0,
            structured_output=option,
        )
        assert tokens == ref.token_ids
        assert last.timings.prefill_worker == prefill.worker_id
        drafted += last.timings.draft_tokens
    assert drafted > 0, "the speculative worker verified drafts under the grammar"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
        ),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ],
)
def test_an_invalid_structured_output_is_400_naming_the_field(
    url: str, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": SMOL, "messages": CHAT, "max_tokens": 4, **fields}
    r = http_post(f"{url}/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == (param or "response_format"), r.text


def test_grpc_invalid_structured_output_is_invalid_argument(smol: LocalCluster) -> None:
    assert smol.address is not None
    e = grpc_error(
        smol.address.grpc_target,
        "Hello",
        max_tokens=4,
        structured_output=api_pb2.StructuredOutput(regex="(unclosed"),
    )
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in (e.details() or "")


# -- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_steers_the_output_and_bad_biases_are_400(
    url: str, client: openai.OpenAI
) -> None:
    token = http_post(f"{url}/tokenize", {"prompt": " zebra"}).json()["tokens"][0]
    text = http_post(f"{url}/detokenize", {"tokens": [token] * 3}).json()["prompt"]
    r = client.completions.create(
        model=SMOL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
    )
    assert r.choices[0].text == text
    for bias, message in [
        ({str(token): 101}, "[-100, 100]"),
        ({"49152": 1}, "token ids"),
        ({"zebra": 1}, "integers"),
    ]:
        body = {"model": SMOL, "messages": CHAT, "max_tokens": 1, "logit_bias": bias}
        r = http_post(f"{url}/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias" and message in error["message"], error


# -- n choices -------------------------------------------------------------------------------


def test_n_choices_are_indexed_seeded_and_count_the_prompt_once(
    smol: LocalCluster, client: openai.OpenAI
) -> None:
    def ask(n: int) -> Any:
        return client.chat.completions.create(
            model=SMOL,
            messages=CHAT,
            n=n,
            max_tokens=6,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True},
        )

    one, three = ask(1), ask(3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) > 1  # choice i draws with seed + i
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 6
    wait_workers_idle(workers(smol), 10.0)


def test_n_choices_are_prefilled_and_sent_once(smol: LocalCluster, url: str) -> None:
    """A prompt for the prefill worker (> 32 tokens) with n = 3: one prefill and one KV transfer
    serve the three choices; no block is left on any worker."""
    (prefill,) = workers(smol, "prefill")
    wait_workers_idle(workers(smol), 5.0)
    before = scrape(prefill.metrics_url)
    prompt = "Tell me about the sea, the ships on it and the lighthouses along its coasts. " * 3
    body = {"model": SMOL, "prompt": prompt, "n": 3, "max_tokens": 4, "seed": 3}
    r = http_post(f"{url}/v1/completions", {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 3 * 4
    after = scrape(prefill.metrics_url)
    assert after["tandem_kv_transfers"] - before["tandem_kv_transfers"] == 1
    wait_workers_idle(workers(smol), 10.0)


def grpc_choices(target: str, n: int, **sampling: Any) -> dict[int, list[int]]:
    """Each choice's tokens from one Generate call with `n` choices."""
    request = generate_request("Once upon a time", **sampling)
    request.n = n
    request.speculative = False  # seeded draws differ under speculation (docs/engine.md)
    tokens: dict[int, list[int]] = {}
    with grpc.insecure_channel(target) as channel:
        for msg in api_pb2_grpc.TandemStub(channel).Generate(request, timeout=60):
            tokens.setdefault(msg.index, []).extend(msg.token_ids)
            if msg.finish_reason:
                assert msg.usage.completion_tokens == len(tokens[msg.index])
    return tokens


def test_seeded_choices_are_reproducible_over_grpc(smol: LocalCluster) -> None:
    target = smol.address.grpc_target
    sampling = {"max_tokens": 4, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    three = grpc_choices(target, 3, **sampling)
    assert sorted(three) == [0, 1, 2] and all(len(t) == 4 for t in three.values())
    assert three == grpc_choices(target, 3, **sampling)
    assert three[0] == grpc_choices(target, 1, **sampling)[0]  # choice 0 keeps the seed


def test_n_choices_stream_with_their_index(url: str) -> None:
    body = {"model": SMOL, "prompt": "Once upon a time", "n": 2, "max_tokens": 4}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = list(sse_events(r.iter_lines()))
    chunks = [e for e in events if e["choices"]]
    finished = sorted(c["index"] for e in chunks for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1]
    assert {len(e["choices"]) for e in chunks} == {1}
    assert events[-1]["usage"]["completion_tokens"] == 8
    for n in (0, 129):
        r = http_post(f"{url}/v1/completions", {**body, "stream": False, "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


# -- roles, continue_final_message, tools ----------------------------------------------------

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
WEATHER_CHAT: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def greedy_chat(client: openai.OpenAI, messages: Any, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=SMOL, messages=messages, max_tokens=8, temperature=0, **kwargs
    )


def test_developer_is_system_and_a_final_message_can_be_continued(
    url: str, client: openai.OpenAI, smollm2_path: Any
) -> None:
    system = [{"role": "system", "content": "Answer in French."}, *CHAT]
    developer = [{"role": "developer", "content": "Answer in French."}, *CHAT]
    assert (
        greedy_chat(client, developer).choices[0].message.content
        == greedy_chat(client, system).choices[0].message.content
    )
    started: Any = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    r = greedy_chat(client, started, extra_body=extra)
    prompt = load_tokenizer(smollm2_path).apply_chat_template(
        started, False, continue_final_message=True
    )
    assert prompt.endswith("Red, green and")  # no end of turn, no new assistant turn
    raw = client.completions.create(model=SMOL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == raw.choices[0].text
    body = {"model": SMOL, "messages": started, "continue_final_message": True}
    r = http_post(f"{url}/v1/chat/completions", body)  # add_generation_prompt defaults to true
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    body = {**body, "messages": CHAT, "add_generation_prompt": False}
    r = http_post(f"{url}/v1/chat/completions", body)
    assert r.status_code == 400 and "final assistant message" in r.text


def tool_calls_of(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[Any, str, str]:
    """The tool calls (as dicts), finish reason and content of one answer, streamed or not."""
    args = {"model": SMOL, "messages": WEATHER_CHAT, "tools": TOOLS, "max_tokens": 60, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason, choice.message.content or ""
    calls, finish, content = [], "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            calls += [t.model_dump(exclude={"index"}) for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
            content += c.delta.content or ""
    return calls, finish, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_and_named_tool_choices_give_arguments_that_validate(
    client: openai.OpenAI, stream: bool
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        calls, finish, _ = tool_calls_of(client, stream, tool_choice=tool_choice, temperature=0)
        assert finish == "tool_calls" and calls, (tool_choice, calls)
        for c in calls:
            assert c["type"] == "function" and c["id"].startswith("call_")
            name, arguments = c["function"]["name"], json.loads(c["function"]["arguments"])
            assert name in ("get_weather", "get_time")
            if name == "get_weather":
                jsonschema.validate(arguments, WEATHER_PARAMETERS)
            else:
                assert arguments == {}
        if tool_choice == named:
            assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_auto_tool_choice_and_a_tool_call_round_trip(client: openai.OpenAI) -> None:
    # SmolLM2-135M may or may not call: either way the answer is well formed, and the stream
    # (content before any call streams, the calls come at the end) says what the whole answer
    # says.
    whole = tool_calls_of(client, False, temperature=0)
    streamed = tool_calls_of(client, True, temperature=0)
    assert whole[1] in (("tool_calls",) if whole[0] else ("stop", "length"))
    assert [c["function"] for c in streamed[0]] == [c["function"] for c in whole[0]]
    assert streamed[1] == whole[1] and streamed[2].strip() == whole[2].strip()
    # A regex makes the model write a Hermes call with text before it: the auto parser reads it.
    regex = r'Checking\.\n<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    for stream in (False, True):
        calls, finish, content = tool_calls_of(
            client, stream, temperature=0, extra_body={"guided_regex": regex}
        )
        assert finish == "tool_calls" and content.strip() == "Checking.", (stream, content)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_time", "{}")
        ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    history: Any = [
        *WEATHER_CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    for tool_choice in ("auto", "none"):
        r = greedy_chat(client, history, tools=TOOLS, tool_choice=tool_choice)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = greedy_chat(client, history, tool_choice="none")  # no tools: the history still renders
    assert r.choices[0].message.content


def test_bad_tool_requests_are_400_naming_the_field(url: str) -> None:
    base = {"model": SMOL, "messages": WEATHER_CHAT, "max_tokens": 4}
    for extra, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ]:
        r = http_post(f"{url}/v1/chat/completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())


def grpc_tool_answer(
    smol: LocalCluster,
    chat: list[api_pb2.ChatMessage],
    tool_choice: api_pb2.ToolChoice | None = None,
    sampling: api_pb2.SamplingOptions | None = None,
) -> tuple[list[Any], str, str]:
    """(tool calls as (name, arguments), finish reason, text) of one greedy gRPC answer."""
    assert smol.address is not None
    tools = [
        api_pb2.Tool(
            name=t["function"]["name"],
            description=t["function"]["description"],
            parameters=json.dumps(t["function"]["parameters"])
            if "parameters" in t["function"]
            else "",
        )
        for t in TOOLS
    ]
    request = api_pb2.GenerateRequest(
        chat=api_pb2.ChatMessages(messages=chat),
        sampling=sampling or api_pb2.SamplingOptions(max_tokens=60, temperature=0.0),
        tools=tools,
        tool_choice=tool_choice,
    )
    with grpc.insecure_channel(smol.address.grpc_target) as channel:
        messages = list(api_pb2_grpc.TandemStub(channel).Generate(request, timeout=120))
    calls = [(c.name, c.arguments) for m in messages for c in m.tool_calls]
    assert all(c.id.startswith("call_") for m in messages for c in m.tool_calls)
    return calls, messages[-1].finish_reason, "".join(m.text for m in messages)


def test_grpc_tool_calls_are_the_http_api_s(smol: LocalCluster, client: openai.OpenAI) -> None:
    """Over gRPC, through the same path as HTTP's (`router/tools.py`): required and named
    choices, an auto answer with content before its call, a round trip with a tool result,
    and bad tools are INVALID_ARGUMENT naming the field."""
    weather = [api_pb2.ChatMessage(role="user", content=WEATHER_CHAT[0]["content"])]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, http_choice in [
        (api_pb2.ToolChoice(mode="required"), "required"),
        (api_pb2.ToolChoice(function="get_weather"), named),
    ]:
        calls, finish, text = grpc_tool_answer(smol, weather, choice)
        http = tool_calls_of(client, False, tool_choice=http_choice, temperature=0)
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in http[0]]
        assert (finish, text) == (http[1], "") == ("tool_calls", "")
    regex = r'Checking\.\n<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    sampling = api_pb2.SamplingOptions(
        max_tokens=60, temperature=0.0, structured_output=api_pb2.StructuredOutput(regex=regex)
    )
    calls, finish, text = grpc_tool_answer(smol, weather, sampling=sampling)
    assert (calls, finish, text.strip()) == ([("get_time", "{}")], "tool_calls", "Checking.")
    call = api_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    history = [
        *weather,
        api_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        api_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="18 C and sunny"),
    ]
    _, finish, text = grpc_tool_answer(smol, history, api_pb2.ToolChoice(mode="none"))
    assert finish in ("stop", "length") and text
    hi = api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content="Hi")])
    for bad, name in [
        (api_pb2.GenerateRequest(chat=hi, tools=[api_pb2.Tool(name="f", parameters="{")]), "tools"),
        (
            api_pb2.GenerateRequest(chat=hi, tool_choice=api_pb2.ToolChoice(mode="some")),
            "tool_choice",
        ),
        (api_pb2.GenerateRequest(prompt="Hi", tools=[api_pb2.Tool(name="f")]), "tools"),
    ]:
        assert smol.address is not None
        channel = grpc.insecure_channel(smol.address.grpc_target)
        with channel, pytest.raises(grpc.RpcError) as raised:
            list(api_pb2_grpc.TandemStub(channel).Generate(bad, timeout=30))
        e: Any = raised.value
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and name in (e.details() or ""), bad


# -- completions: echo, lists of prompts, suffix ---------------------------------------------


def test_echo_and_a_list_of_prompts(url: str, client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]

    def complete(prompt: Any, **kwargs: Any) -> Any:
        return client.completions.create(
            model=SMOL, prompt=prompt, max_tokens=4, temperature=0, **kwargs
        )

    alone = [complete(p).choices[0].text for p in prompts]
    both = complete(prompts, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = [http_post(f"{url}/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    assert both.usage is not None and both.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert [c.text for c in complete(ids).choices] == alone

    echoed = complete(prompts[0], echo=True).choices[0]
    assert echoed.text == prompts[0] + alone[0]
    streamed = complete(prompts[0], echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompts[0] + alone[0]
    only = client.completions.create(model=SMOL, prompt=prompts, echo=True, max_tokens=0)
    assert [c.text for c in only.choices] == prompts
    assert only.usage is not None and only.usage.completion_tokens == 0

    base = {"model": SMOL, "prompt": prompts[0], "max_tokens": 2}
    for extra, param in [
        ({"suffix": " and that is all."}, "suffix"),
        ({"prompt": []}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
    ]:
        r = http_post(f"{url}/v1/completions", {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())


# -- prompt logprobs: vLLM's prompt_logprobs, and echo with logprobs -------------------------

LONG_PROMPT = (
    "The river rose in the spring, and the village moved its boats to the high field behind the "
    "mill, where they waited until the water went down again. Then the fishermen carried them "
    "back to the bank, one by one, and the market opened on the square."
)  # longer than local_prefill_tokens: prefilled on the prefill worker


def test_prompt_logprobs_equal_the_offline_engine(
    url: str, client: openai.OpenAI, smol: LocalCluster, smol_llm: LLM
) -> None:
    """Computed on the prefill worker (over HTTP and gRPC, where the prompt skips the prefix
    cache it filled the first time), each equals the offline engine's; the first token has
    none. Echo with logprobs puts them before the output's; with max_tokens 0 it is the prompt
    alone. Streaming with prompt_logprobs is a 400 naming it (as vLLM)."""
    assert smol.address is not None
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    ref = [lp.logprob for lp in smol_llm.generate(LONG_PROMPT, params)[0].prompt_logprobs]
    ids = http_post(f"{url}/tokenize", {"prompt": LONG_PROMPT}).json()["tokens"]
    assert len(ref) == len(ids) - 1

    def close(ours: list[float | None]) -> None:
        assert ours[0] is None and len(ours) == len(ids)
        assert ours[1:] == pytest.approx(ref, abs=1e-3)

    body = {"model": SMOL, "prompt": LONG_PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
    for _ in range(2):  # the second time, the prompt's blocks are in the prefix cache
        scores = http_post(f"{url}/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
        close([s and s[str(t)]["logprob"] for s, t in zip(scores, ids, strict=True)])
        assert all(len(s) in (2, 3) for s in scores[1:])  # the token, and its top 2

    echoed = client.completions.create(
        model=SMOL, prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    assert echoed.choices[0].text == LONG_PROMPT and echoed.choices[0].logprobs is not None
    assert echoed.usage is not None and echoed.usage.completion_tokens == 0
    close(echoed.choices[0].logprobs.token_logprobs or [])
    stream = client.completions.create(
        model=SMOL, prompt=LONG_PROMPT, max_tokens=2, echo=True, logprobs=1, stream=True
    )
    streamed = [
        lp
        for c in stream
        if c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs or []
    ]
    close(streamed[: len(ids)])
    assert len(streamed) == len(ids) + 2

    with grpc.insecure_channel(smol.address.grpc_target) as channel:
        request = generate_request(LONG_PROMPT, max_tokens=2, temperature=0.0, prompt_logprobs=0)
        messages = list(api_pb2_grpc.TandemStub(channel).Generate(request, timeout=60))
    close([None] + [lp.logprob for lp in messages[0].prompt_logprobs])
    assert messages[-1].timings.prefill_worker == workers(smol, "prefill")[0].worker_id

    chat = http_post(
        f"{url}/v1/chat/completions",
        {"model": SMOL, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    r = http_post(f"{url}/v1/completions", {**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_top_logprobs_come_with_logprobs_only(url: str) -> None:
    """`top_logprobs` n gives each output token's n most likely ones, and asks for `logprobs:
    true` (a 400 naming it otherwise, as vLLM answers; it was silently ignored); 0 asks for
    nothing."""
    body = {"model": SMOL, "messages": CHAT, "max_tokens": 3, "temperature": 0.0}
    answer = http_post(
        f"{url}/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2}
    ).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 2 for t in content)
    assert all(t["logprob"] == t["top_logprobs"][0]["logprob"] for t in content)  # greedy
    r = http_post(f"{url}/v1/chat/completions", {**body, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert http_post(f"{url}/v1/chat/completions", {**body, "top_logprobs": 0}).status_code == 200


# -- odd numbers in every numeric field: a 200 or a 400 naming it, never a 500 or a hang -----

# Past the wire's int32 / int64 / uint64, the float extremes, and JSON's NaN and Infinity tokens.
ODD_NUMBERS = [-1, 0, 0.5, 2**31, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, math.nan, math.inf]
ODD_LISTS_AND_MAPS = [
    ("stop_token_ids", [2**31]), ("stop_token_ids", [2**64]), ("stop_token_ids", [-1]),
    ("logit_bias", {str(2**40): 1}), ("logit_bias", {"1": math.nan}),
    ("logit_bias", {"1": math.inf}), ("logit_bias", {"-1": 1}),
]  # fmt: skip
ODD_PROMPTS = [[2**31], [2**64], [-1], [[2**63]]]  # token ids as a completion's prompt
# What a field's odd value needs beside it to be read at all, and the fields its 400 may name
# instead of it (a length past the context is the prompt's or the messages' fault too).
NEEDS = {"max_completion_tokens": {"max_tokens": None}, "top_logprobs": {"logprobs": True}}
ALSO_NAMED = {"max_tokens": {"prompt", "messages"}, "max_completion_tokens": {"prompt", "messages"}}


def numeric_fields(request: type[BaseModel]) -> list[str]:
    """The fields of `request` that take one number (timeout aside: a small one is a fair 504,
    and tests/cluster/test_smol_cluster.py sends it NaN)."""
    numbers = (int, float, int | None, float | None)
    return sorted(
        name
        for name, field in request.model_fields.items()
        if field.annotation in numbers and name != "timeout"
    )


def test_odd_numbers_in_every_numeric_field_get_a_200_or_a_400_naming_it(
    url: str, smol: LocalCluster
) -> None:
    """Fuzzing found a 500 (top_k past int32, a seed past int64) and a 504 (a NaN timeout):
    every numeric field of both endpoints, the number lists and maps, and a prompt's token ids
    get each odd number."""
    cases = [
        (path, base, name, value)
        for path, _, request, base in ENDPOINTS
        for name in numeric_fields(request)
        for value in ODD_NUMBERS
    ]
    cases += [(p, b, name, value) for p, _, _, b in ENDPOINTS for name, value in ODD_LISTS_AND_MAPS]
    cases += [(ENDPOINTS[1][0], ENDPOINTS[1][3], "prompt", value) for value in ODD_PROMPTS]

    def answer(case: tuple[str, dict[str, Any], str, Any]) -> str | None:
        path, base, name, value = case
        body = {**base, "max_tokens": 2, **NEEDS.get(name, {}), name: value}
        raw = json.dumps({k: v for k, v in body.items() if v is not None}).encode()  # NaN too
        r = http_post(f"{url}{path}", raw=raw)
        if r.status_code == 400 and r.json()["error"]["param"] in {name, *ALSO_NAMED.get(name, ())}:
            return None
        if r.status_code == 200 and r.json()["choices"]:
            return None
        return f"{path} {name}={value}: {r.status_code} {r.text[:200]}"

    with ThreadPoolExecutor(4) as pool:
        wrong = [w for w in pool.map(answer, cases) if w is not None]
    assert not wrong, wrong
    wait_workers_idle(workers(smol), 5.0)  # nothing left running, no block held
