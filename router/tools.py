"""Tool calling: OpenAI's `tools` and `tool_choice` turned into a prompt, a constraint and a parse.

- `none`: the model answers in text; the tools are not shown to it.
- `auto` (the default with tools): the tools go to the chat template, and the answer is parsed
  for calls in the model's format (`RouterConfig.tool_call_parser`, `PARSERS`; `auto` reads it
  from the chat template, `parser_for_template`): `hermes`,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the Hermes, Qwen 2.5 and
  SmolLM2-style ChatML templates ask for), or `llama3_json`, the answer itself one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;`, perhaps after
  `<|python_tag|>` (Llama 3.1-3.3); text without a readable call is the answer's content.
- `required`: the output is constrained (structured outputs, llguidance) to a JSON array of
  `{"name", "parameters"}` objects, one of the tools each; `parallel_tool_calls: false` allows one.
- a named function: the output is constrained to that function's `parameters` schema, and is
  its arguments.

A chat template that does not render tools itself (`Tokenizer.renders_tools`: SmolLM2's, say)
gets them the Hermes way (`hermes_messages`): a system message listing them in `<tools>`, the
assistant's earlier calls as `<tool_call>` blocks in its content, and tool results as user
messages in `<tool_response>` blocks.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.errors import invalid
from tandem.sampling_params import SamplingParams
from tandem.structured import StructuredOutput

_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions.\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=_call_id, compare=False)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and how it may use them (`of` checks them: 400 naming the field)."""

    tools: tuple[dict[str, Any], ...]  # the function definitions (`tools[i].function`)
    choice: str  # "none", "auto", "required", or "function" (then `name`)
    name: str = ""
    parallel: bool = True
    parser: str = "hermes"  # a key of PARSERS: the format of an `auto` answer's calls

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        parallel: bool | None,
        parser: str = "hermes",
    ) -> ToolUse | None:
        """None without tools (and with tool_choice `none` or unset)."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise invalid("tool_choice needs tools", "tool_choice")
            return None
        functions = tuple(_function(t, i) for i, t in enumerate(tools))
        names = [f["name"] for f in functions]
        if tool_choice is None or tool_choice in ("none", "auto", "required"):
            return cls(functions, tool_choice or "auto", "", parallel is not False, parser)
        name = _named(tool_choice)
        if name not in names:
            raise invalid(
                f"tool_choice names {name!r}, which is not among tools {names}", "tool_choice"
            )
        return cls(functions, "function", name, parallel is not False, parser)

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (none with `none`)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f} for f in self.tools]

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that `required` and a named function put on the output."""
        if self.choice == "function":
            function = next(f for f in self.tools if f["name"] == self.name)
            return StructuredOutput.json_schema(function["parameters"], "tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput.json_schema(schema, "tool_choice")

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the constraint the tool choice puts on the output, if any; another
        structured output beside it is a 400 naming `tool_choice`."""
        constraint = self.structured_output()
        if constraint is None:
            return params
        if params.structured_output is not None:
            raise invalid(
                f"tool_choice {self.choice} constrains the output; "
                f"it cannot be combined with {params.structured_output.source}",
                "tool_choice",
            )
        return replace(params, structured_output=constraint)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and tool calls; no calls (the text as content) when the text
        holds none that can be read."""
        if self.choice == "function":
            return (None, [ToolCall(self.name, text)]) if _is_json(text) else (text, [])
        if self.choice == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls
        return PARSERS[self.parser].parse(text, self.parallel)

    def streamable_prefix(self, text: str) -> int:
        """How much of an `auto` answer can stream as content now."""
        return PARSERS[self.parser].streamable_prefix(text)


def finish_reason(calls: Sequence[ToolCall], reason: str | None) -> str | None:
    """An answer that stopped with tool calls ends with `tool_calls`, as OpenAI's do."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class ToolStream:
    """One answer with tools as it streams (the HTTP API's chunks, gRPC's messages): its text so
    far, and how much of it went out as content."""

    use: ToolUse
    text: str = ""
    sent: int = 0

    def add(self, text: str, reason: str | None) -> tuple[str, list[ToolCall], str | None]:
        """For `text` more of the answer: the content that goes out now and, at the answer's end
        (`reason` set), its calls and finish reason. An `auto` answer's text streams up to where
        a call may begin; a `required` or named one is all call, held to its end."""
        self.text += text
        finished = reason is not None
        calls = self.use.parse(self.text)[1] if finished else []
        end = len(self.text)
        if calls or not finished:  # what may be a call is held back
            end = self.use.streamable_prefix(self.text) if self.use.choice == "auto" else 0
        content = self.text[self.sent : max(end, self.sent)]
        self.sent += len(content)
        return content, calls, finish_reason(calls, reason)


def template_message(
    index: int,
    role: str,
    content: str | None,
    tool_calls: Sequence[ToolCall] | None = None,
    tool_call_id: str | None = None,
) -> dict[str, Any]:
    """Chat message `index` as a chat template reads it: role and content, an assistant's tool
    calls with their arguments as objects (as vLLM passes them), a tool message's call id. A
    message of the wrong shape is a 400 naming `messages`."""
    where = f"messages[{index}]"
    if content is None and not (role == "assistant" and tool_calls):
        raise invalid(f"{where} needs content", "messages")
    if tool_calls is not None and role != "assistant":
        raise invalid(f"{where}: only assistant messages have tool_calls", "messages")
    if (role == "tool") != (tool_call_id is not None):
        raise invalid(f"{where}: tool messages, and only they, have tool_call_id", "messages")
    message: dict[str, Any] = {"role": role, "content": content or ""}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c, where)},
            }
            for c in tool_calls
        ]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    return message


def _arguments(call: ToolCall, where: str) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        message = f"{where}: tool call {call.id} has arguments that are not JSON"
        raise invalid(message, "messages") from None


def parse_hermes(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style calls: the text before the first `<tool_call>` is the content; each block
    holds `{"name", "arguments"}` (a last block may lack its closing tag, as when the model
    stops there). Any block that does not read: no calls, the whole text is the content."""
    start = text.find(_TAG)
    if start < 0:
        return text, []
    calls = []
    for block in _CALL.findall(text, start):
        try:
            call = _read_call(json.loads(block))
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip() or None
    return content, calls if parallel else calls[:1]


def streamable_prefix(text: str) -> int:
    """How much of an `auto` answer can stream as content now: the text before a `<tool_call>`,
    or before an end that may begin one."""
    start = text.find(_TAG)
    if start >= 0:
        return start
    for k in range(min(len(_TAG) - 1, len(text)), 0, -1):
        if text.endswith(_TAG[:k]):
            return len(text) - k
    return len(text)


def _read_call(call: Any) -> ToolCall | None:
    """A `{"name", "arguments" | "parameters"}` object as a call; None if it is not one."""
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments", call.get("parameters", {}))
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments))


def parse_llama3_json(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's JSON calls: the whole answer (after an optional `<|python_tag|>`) is one or more
    `{"name", "parameters"}` objects separated by `;`. Anything else: no calls, the text is the
    content."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _read_call(value)
        if call is None:
            return text, []
        calls.append(call)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return None, calls if parallel else calls[:1]


def llama3_streamable_prefix(text: str) -> int:
    """An answer that begins (after spaces) like a call, `{` or `<|python_tag|>`, is held to its
    end; any other streams as it comes."""
    head = text.lstrip()
    if not head or head.startswith("{") or head.startswith(_PYTHON_TAG):
        return 0
    return 0 if _PYTHON_TAG.startswith(head) else len(text)


@dataclass(frozen=True)
class ToolParser:
    """One model family's tool-call format: read a whole answer, and tell how much of a partial
    one is surely content (streams at once)."""

    parse: Callable[[str, bool], tuple[str | None, list[ToolCall]]]
    streamable_prefix: Callable[[str], int]


PARSERS = {
    "hermes": ToolParser(parse_hermes, streamable_prefix),
    "llama3_json": ToolParser(parse_llama3_json, llama3_streamable_prefix),
}


def parser_for_template(name: str, chat_template: str | None) -> str:
    """The parser `name` (`RouterConfig.tool_call_parser`) or, for `auto`, the one the chat
    template asks for: Llama 3's (`<|python_tag|>` / the `ipython` role) or else Hermes's (also
    how tools are rendered for a template that renders none, `hermes_messages`)."""
    if name != "auto":
        return name
    template = chat_template or ""
    return "llama3_json" if _PYTHON_TAG in template or "ipython" in template else "hermes"


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The messages for a template that does not render tools: the tools in a system message
    (after the request's own system text), calls and results as Hermes blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        elif m.get("tool_calls"):
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            out.append({"role": m["role"], "content": "\n".join([m["content"], *blocks]).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        system = _HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """The function of `tools[index]`, with `parameters` (an empty object schema if none)."""
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict):
        raise invalid(
            f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid(f"tools[{index}].function needs a name", "tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise invalid(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
    return {**function, "parameters": parameters}


def _named(tool_choice: Any) -> str:
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        return str(tool_choice["function"]["name"])
    raise invalid(
        "tool_choice must be none, auto, required or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
