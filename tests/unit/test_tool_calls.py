"""Tool calling's pure parts: the Hermes parser on fixed model outputs, the tool choice checks
and constraints, the Hermes rendering for templates without tools, and continue_final_message on
SmolLM2's template (the chat template of the default model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from router.errors import RouterError
from router.tools import (
    ToolCall,
    ToolUse,
    hermes_messages,
    llama3_streamable_prefix,
    parse_hermes,
    parse_llama3_json,
    parser_for_template,
    streamable_prefix,
)
from tandem.config import RouterConfig
from tandem.tokenizer import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [call("get_weather", city="Paris")],
        ),
        (
            'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Let me check.",
            [call("get_weather", city="Oslo"), call("get_time")],
        ),
        # The model stopped before the closing tag.
        (
            '<tool_call>{"name": "get_time", "arguments": {}}',
            None,
            [call("get_time")],
        ),
        # A block that does not read: the whole text is the content.
        ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
    ],
    ids=["text", "one", "two-after-content", "unclosed", "truncated", "no-name"],
)
def test_hermes_parser_on_fixed_outputs(
    text: str, content: str | None, calls: list[ToolCall]
) -> None:
    assert parse_hermes(text) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 2
    assert parse_hermes(text, parallel=False) == (None, [call("a")])


def test_required_and_named_constrain_with_schemas_that_the_parse_reads() -> None:
    required = ToolUse.of([WEATHER, TIME], "required", None)
    assert required is not None
    so = required.structured_output()
    assert so is not None and so.source == "tool_choice"
    so.validate()  # llguidance accepts it
    schema = json.loads(so.spec)
    answer = [
        {"name": "get_weather", "parameters": {"city": "Rome"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(answer, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    assert required.parse(json.dumps(answer)) == (
        None,
        [call("get_weather", city="Rome"), call("get_time")],
    )
    single = ToolUse.of([WEATHER], "required", False)
    assert single is not None and json.loads(single.structured_output().spec)["maxItems"] == 1  # type: ignore[union-attr]

    named = ToolUse.of(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None
    )
    assert named is not None and named.structured_output() is not None
    assert json.loads(named.structured_output().spec) == WEATHER["function"]["parameters"]  # type: ignore[index,union-attr]
    assert named.parse('{"city":"Rome"}') == (None, [ToolCall("get_weather", '{"city":"Rome"}')])
    assert named.parse('{"city":"Ro') == ('{"city":"Ro', [])  # cut by max_tokens: text


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        (None, "required", "tool_choice", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        ([WEATHER], "sometimes", "tool_choice", "must be none, auto, required"),
        ([{"type": "retrieval"}], "auto", "tools", "tools[0]"),
        ([{"type": "function", "function": {}}], "auto", "tools", "needs a name"),
    ],
)
def test_bad_tools_and_tool_choices_name_the_field(
    tools: Any, choice: Any, param: str, words: str
) -> None:
    with pytest.raises(RouterError) as e:
        ToolUse.of(tools, choice, None)
    assert e.value.field == param and words in e.value.message


def test_none_and_auto() -> None:
    assert ToolUse.of(None, None, None) is None and ToolUse.of(None, "none", None) is None
    none = ToolUse.of([WEATHER], "none", None)
    assert none is not None and not none.parses and none.prompt_tools is None
    auto = ToolUse.of([WEATHER], None, None)
    assert auto is not None and auto.choice == "auto" and auto.structured_output() is None
    assert auto.prompt_tools == [{"type": "function", "function": WEATHER["function"]}]


def test_hermes_rendering_for_a_template_without_tools() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
    ]
    out = hermes_messages(messages, [TIME])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "get_time"}}\n</tools>'
        in out[0]["content"]
    )
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    assert hermes_messages(messages[1:2], None) == messages[1:2]


def test_continue_final_message_on_smollm2(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    assert not tokenizer.renders_tools  # SmolLM2's template: tools go the Hermes way
    chat = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]
    text = tokenizer.apply_chat_template(chat, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")
    closed = tokenizer.apply_chat_template(chat, False)
    assert closed.startswith(text) and closed.endswith("<|im_end|>\n")


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("Hello", 5),
        ("Hello <tool", 6),  # may begin a call: held back
        ("Hello <", 6),
        ("a < b", 5),  # cannot begin one any more
        ('Hi <tool_call>{"name"', 3),
        ("", 0),
    ],
)
def test_what_an_auto_answer_streams_as_content(text: str, end: int) -> None:
    assert streamable_prefix(text) == end


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Paris is sunny.", "Paris is sunny.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [call("get_weather", city="Paris")],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [call("get_weather", city="Oslo"), call("get_time")],
        ),
        # "arguments" is read too; a truncated or nameless object is content.
        ('{"name": "get_time", "arguments": {}}', None, [call("get_time")]),
        ('{"name": "get_time", "param', '{"name": "get_time", "param', []),
        ('{"parameters": {}}', '{"parameters": {}}', []),
        ('{"name": "get_time", "parameters": {}} and more', None, None),
    ],
    ids=["text", "one", "two-after-tag", "arguments", "truncated", "no-name", "trailing-text"],
)
def test_llama3_json_parser_on_fixed_outputs(
    text: str, content: str | None, calls: list[ToolCall] | None
) -> None:
    if calls is None:  # trailing text after the object: not a call answer, all content
        assert parse_llama3_json(text) == (text, [])
        return
    assert parse_llama3_json(text) == (content, calls)
    if calls:
        assert parse_llama3_json(text, parallel=False) == (None, calls[:1])


@pytest.mark.parametrize(
    ("text", "end"),
    [("Paris", 5), ("  {", 0), ('{"name"', 0), ("<|python", 0), ("<|python_tag|>{", 0), ("", 0)],
)
def test_what_a_llama3_answer_streams_as_content(text: str, end: int) -> None:
    assert llama3_streamable_prefix(text) == end


def test_the_parser_follows_the_chat_template() -> None:
    llama3 = "{%- if tools %}<|start_header_id|>ipython<|end_header_id|>{% endif %}<|python_tag|>"
    assert parser_for_template("auto", llama3) == "llama3_json"
    assert parser_for_template("auto", "{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("auto", None) == "hermes"
    assert parser_for_template("hermes", llama3) == "hermes"  # the option wins
    auto = ToolUse.of([WEATHER], None, None, "llama3_json")
    assert auto is not None and auto.parse('{"name": "get_weather", "parameters": {}}') == (
        None,
        [call("get_weather")],
    )
    assert auto.streamable_prefix("Sunny") == 5
    with pytest.raises(ValueError, match="tool_call_parser"):
        RouterConfig("smollm2-135m", tool_call_parser="mistral")
