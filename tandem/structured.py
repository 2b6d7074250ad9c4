"""Structured outputs: what a request's tokens must match, as the API gave it and as a grammar.

A `StructuredOutput` is one of: a JSON schema, any JSON object, a regular expression, a choice
among fixed strings, or a grammar (Lark in llguidance's dialect, or GBNF as llama.cpp writes
it). `grammar` turns it into one llguidance grammar string, which is also the workers' cache key
for the compiled matcher (`tandem/engine/grammar.py`). `validate` checks it with llguidance,
without a tokenizer and without torch, so the router refuses a bad schema, regex or grammar
before any worker sees the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

# Compact JSON (no optional whitespace): fewer tokens, and a small model cannot wander off in
# spaces and newlines that the schema allows.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. `spec` is the schema as compact JSON text, the
    regex, the choices as a JSON list, the Lark grammar, or "" for any JSON object; `source` is the
    request field it came from, named in errors."""

    kind: Kind
    spec: str = ""
    source: str = field(default="structured_output", compare=False)

    @classmethod
    def json_schema(cls, schema: Any, source: str) -> StructuredOutput:
        """A schema given as a JSON object or as its text; ValueError for other text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{source}: the schema must be a JSON object")
        # Compact, keys in the order given: the output's properties follow the schema's order.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), source)

    @classmethod
    def choice(cls, choices: list[str], source: str) -> StructuredOutput:
        return cls("choice", json.dumps(choices), source)

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) that the output must match; ValueError, naming
        `source`, for a GBNF grammar that cannot be read."""
        import llguidance  # on a grammar's first use: engines without one never load it
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        grammar_from = llguidance.LLMatcher
        if self.kind == "json_schema":
            return grammar_from.grammar_from_json_schema(self.spec, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return grammar_from.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return grammar_from.grammar_from_regex(self.spec)
        if self.kind == "choice":
            # Lark string literals take JSON's escapes, so json.dumps quotes any choice.
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.spec))
            return grammar_from.grammar_from_lark(f"start: {alternatives}")
        try:
            lark = any_to_lark(self.spec)  # GBNF (`root ::=`) too
        except GbnfToLarkError as e:
            raise ValueError(f"{self.source}: invalid grammar: {e}") from None
        return grammar_from.grammar_from_lark(lark)

    def validate(self) -> None:
        """Raise ValueError, naming `source`, unless llguidance accepts the constraint."""
        if self.kind not in KINDS:
            raise ValueError(f"{self.source}: unknown structured output kind {self.kind!r}")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"{self.source}: give at least one choice, none of them empty")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise ValueError(f"{self.source}: the {self.kind} must not be empty")
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar)  # ValueError from grammar
        if error:
            raise ValueError(f"{self.source}: invalid {self.kind.replace('_', ' ')}: {error}")
