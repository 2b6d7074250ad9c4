"""`tandem bench grammar`: the per-token cost of a structured output's token mask, llguidance
(what the workers use) against xgrammar (if installed), on the model's own tokenizer.

For each JSON schema, a valid answer is tokenized with the model's tokenizer; each library
compiles the schema (timed cold, then from its cache), then for every token of the answer fills
the next-token bitmask and accepts the token (mask fills timed one by one). Then the engine's own
path, `tandem.engine.grammar.token_masks` (bitmask -> [batch, vocab] bool), at batch 1 and 16,
per step. No model runs: the figures are the grammar's share of a decode step's time.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import methodcaller
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from tandem import hub
from tandem.engine.grammar import GrammarCache, token_masks
from tandem.model_config import load_config
from tandem.structured import StructuredOutput
from tandem.tokenizer import tokenizer_dir

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "items", "note"],
    "additionalProperties": False,
}
# (name, schema, a valid compact answer)
CASES: tuple[tuple[str, dict[str, Any], str], ...] = (
    (
        "person",
        _PERSON,
        '{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines"],"ok":true}',
    ),
    (
        "order",
        _ORDER,
        '{"id":"AB-1234","status":"paid","items":[{"sku":"pen-blue","qty":3,"price":1.25},'
        '{"sku":"notebook-a5","qty":1,"price":4.5}],"note":null}',
    ),
)


@dataclass
class Figures:
    library: str
    case: str
    tokens: int
    compile_ms: float  # first compile, cold
    cached_ms: float  # a second matcher for the same schema
    mask_us: list[float]  # one fill per token

    def row(self) -> dict[str, Any]:
        masks = sorted(self.mask_us)
        return {
            "library": self.library,
            "schema": self.case,
            "tokens": self.tokens,
            "compile_ms": round(self.compile_ms, 2),
            "cached_ms": round(self.cached_ms, 3),
            "mask_mean_us": round(statistics.mean(masks), 1),
            "mask_p50_us": round(masks[len(masks) // 2], 1),
            "mask_p99_us": round(masks[min(len(masks) - 1, int(len(masks) * 0.99))], 1),
        }


def _llguidance(
    tokenizer_json: str, vocab: int, eos: tuple[int, ...], rounds: int
) -> list[Figures]:
    figures = []
    for case, schema, answer in CASES:
        grammars = GrammarCache(lambda: tokenizer_json, vocab, eos)
        _ = grammars.tokenizer  # once per model, as xgrammar's TokenizerInfo: not compile time
        tokens = Tokenizer.from_str(tokenizer_json).encode(answer, add_special_tokens=False).ids
        structured = StructuredOutput.json_schema(schema, "bench")
        start = time.perf_counter()
        grammars.matcher(structured, [])
        compiled = time.perf_counter()
        grammars.matcher(structured, [])
        cached = time.perf_counter()
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        masks = _mask_times(
            rounds,
            tokens,
            functools.partial(grammars.matcher, structured, []),
            methodcaller("fill_rows", bitmask, 0, ()),
            lambda m, token: m.accept(token),
        )
        figures.append(
            Figures("llguidance", case, len(tokens), (compiled - start) * 1e3,
                    (cached - compiled) * 1e3, masks)
        )  # fmt: skip
    return figures


def _xgrammar(tokenizer_file: str, vocab: int, eos: tuple[int, ...], rounds: int) -> list[Figures]:
    try:
        import xgrammar as xgr
    except ImportError:
        return []
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(eos))
    figures = []
    for case, schema, answer in CASES:
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        text = json.dumps(schema)
        options: dict[str, Any] = {"any_whitespace": False, "separators": (",", ":")}
        start = time.perf_counter()
        grammar = compiler.compile_json_schema(text, **options)
        compiled = time.perf_counter()
        compiler.compile_json_schema(text, **options)
        cached = time.perf_counter()
        tokens = hf.encode(answer, add_special_tokens=False)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        masks = _mask_times(
            rounds,
            tokens,
            functools.partial(xgr.GrammarMatcher, grammar),
            methodcaller("fill_next_token_bitmask", bitmask),
            lambda m, token: m.accept_token(token),
        )
        figures.append(
            Figures("xgrammar", case, len(tokens), (compiled - start) * 1e3,
                    (cached - compiled) * 1e3, masks)
        )  # fmt: skip
    return figures


def _mask_times(
    rounds: int,
    tokens: list[int],
    new_matcher: Callable[[], Any],
    fill: Callable[[Any], object],
    accept: Callable[[Any, int], bool],
) -> list[float]:
    """Microseconds of each next-token mask fill along `tokens`, `rounds` times over, each round
    with a fresh matcher; AssertionError if the grammar refuses the answer."""
    times = []
    for _ in range(rounds):
        matcher = new_matcher()
        for token in tokens:
            t0 = time.perf_counter()
            fill(matcher)
            times.append((time.perf_counter() - t0) * 1e6)
            assert accept(matcher, token), f"the grammar refused token {token} of the answer"
    return times


def _engine_step_us(tokenizer_json: str, vocab: int, eos: tuple[int, ...], batch: int) -> float:
    """token_masks for `batch` requests, all at the start of the person schema: µs per step."""
    grammars = GrammarCache(lambda: tokenizer_json, vocab, eos)
    structured = StructuredOutput.json_schema(_PERSON, "bench")
    rows = [(grammars.matcher(structured, []), ()) for _ in range(batch)]
    device = torch.device("cpu")
    steps = []
    for _ in range(51):
        start = time.perf_counter()
        token_masks(rows, vocab, device)
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[1:]) * 1e6  # the first one warms up


def run_grammar_bench(model: str, rounds: int, json_out: str | None, console: Console) -> None:
    path = hub.resolve(model)
    cfg = load_config(path)
    tokenizer_file = tokenizer_dir(path) / "tokenizer.json"
    tokenizer_json = tokenizer_file.read_text()
    vocab, eos = cfg.vocab_size, tuple(cfg.eos_token_ids)
    rows = [
        f.row()
        for f in _llguidance(tokenizer_json, vocab, eos, rounds)
        + _xgrammar(str(tokenizer_file), vocab, eos, rounds)
    ]
    steps = {b: _engine_step_us(tokenizer_json, vocab, eos, b) for b in (1, 16)}
    table = Table(title=f"Token mask cost, {model} (vocab {vocab})")
    for name in rows[0]:
        table.add_column(name)
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    console.print(table)
    for b, us in steps.items():
        console.print(f"engine token_masks, batch {b}: {us:.0f} µs per step (llguidance)")
    if json_out:
        report = {"model": model, "vocab": vocab, "masks": rows, "engine_step_us": steps}
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
