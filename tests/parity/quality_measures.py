"""The quality measures the weight and KV-cache quantization tests share (test_quant_quality.py,
test_kv_quant_quality.py): perplexity of Spec-Bench reference answers and greedy continuations of
Spec-Bench questions, on the real SmolLM2-135M-Instruct; `conftest.py` scores the bfloat16
reference once per session."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.data import SPECBENCH_PATH
from tandem.engine import LLM, SamplingParams
from tandem.engine.quant.lm_head import KERNEL_MAX_ROWS

# Reference answers with short questions (the long input-grounded ones would time the prefill):
# worked arithmetic, translations, physics and code answers, per category the first ones; ~2,400
# answer tokens. (With 6 answers, 336 tokens, a bfloat16 rounding change anywhere in the model,
# RoPE's for one, moved the fp8 KV cache's increase from -0.1% to +2.3%; over these 22 it moved
# from +0.0% to +0.4%.)
PERPLEXITY_ANSWERS = {"math_reasoning": 8, "translation": 8, "stem": 4, "coding": 2}
GREEDY_CATEGORIES = ("qa", "writing", "coding", "math", "roleplay", "translation")
GREEDY_PER_CATEGORY = 4
GREEDY_TOKENS = 16


def questions() -> list[dict]:
    return [json.loads(line) for line in SPECBENCH_PATH.read_text().splitlines() if line.strip()]


def answer_pairs() -> list[tuple[str, str]]:
    """(question, reference answer) pairs, the first ones of each category in PERPLEXITY_ANSWERS."""
    left = dict(PERPLEXITY_ANSWERS)
    pairs = []
    for q in questions():
        if left.get(q["category"], 0) > 0 and q.get("reference", [""])[0]:
            left[q["category"]] -= 1
            pairs.append((q["turns"][0], q["reference"][0]))
    return pairs


def greedy_prompts() -> list[str]:
    first: dict[str, list[str]] = {c: [] for c in GREEDY_CATEGORIES}
    for q in questions():
        if len(first.get(q["category"], [""] * GREEDY_PER_CATEGORY)) < GREEDY_PER_CATEGORY:
            first[q["category"]].append(q["turns"][0])
    return [p for c in GREEDY_CATEGORIES for p in first[c]]


def perplexity(llm: LLM, prompt_logits: Callable[..., torch.Tensor]) -> float:
    """exp(mean negative log-likelihood) of every answer token given its question."""
    nll, count = 0.0, 0
    for question, answer in answer_pairs():
        prompt = llm.apply_chat_template([{"role": "user", "content": question}])
        target = list(llm.tokenizer(answer, add_special_tokens=False)["input_ids"])
        # Logits at position i predict token i + 1: the answer's come from len(prompt) - 1 on.
        ids, first = prompt + target[:-1], len(prompt) - 1
        logits = prompt_logits(llm.engine, ids, first, rows=KERNEL_MAX_ROWS)
        nll += float(F.cross_entropy(logits, torch.tensor(target), reduction="sum"))
        count += len(target)
    return math.exp(nll / count)


def greedy(llm: LLM) -> list[list[int]]:
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in greedy_prompts()]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS, temperature=0.0)
    return [out.token_ids for out in llm.generate(prompts, params)]


def score(
    model: Path, prompt_logits: Callable[..., torch.Tensor], **options: str | None
) -> tuple[float, list[list[int]]]:
    """(perplexity, greedy tokens) of a bfloat16 engine of `model` with `options`."""
    llm = LLM(str(model), dtype="bfloat16", memory_gib=0.05, **options)
    return perplexity(llm, prompt_logits), greedy(llm)
