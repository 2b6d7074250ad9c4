"""Speculative decoding keeps the target distribution, end to end through the engine.

N seeded requests of one prompt run batched through the real `EngineCore` (scheduler with
continuous batching, chunked prefill, prefix cache and preemption; paged KV; runner; SDPA
attention; `rejection_sample`) around `HashLM`, a tiny-vocabulary target whose distribution
hashes the whole prefix it reads back from the KV cache (`spec_doubles.py`). Drafts come from
`HashDraft` (sampled from its own q, handed over) or the n-gram proposer (one-hot). For every
output position, a chi-square test compares the emitted (previous token, token) pairs with their
exact probability, enumerated over all prefixes; the positions include tokens after a rejection,
corrections and bonus tokens. Mutated verifiers (resample from p instead of the residual, bonus
from q, accept always) must fail the same check. After every step the blocks pass
`check_integrity()` and each running request's visible slots hold exactly its kept tokens.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare
from spec_doubles import (
    MAX_LEN,
    TARGET_SALT,
    VOCAB,
    HashDraft,
    extend,
    hash_engine,
    hash_logits,
    prefix_hash,
    shifted_rows,
    softmax,
)
from torch import Tensor

from tandem.engine import runner as runner_module
from tandem.engine.engine_core import EngineCore
from tandem.engine.spec.acceptance import SpecStats
from tandem.engine.spec.rejection import VerifyOutput, rejection_sample
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_REQUESTS = 4000
PROMPT = (0, 3, 1, 4, 2)
NUM_OUT = 8  # output positions checked; with K = 3 they hold corrections, bonus tokens and
# tokens right after a rejection
K = 3
TEMPERATURE = 0.8
TOP_K = 4  # one token of the five is cut: drafts of a zero-probability token must be rejected
PROPOSERS = ("hash_draft", "ngram")
ALPHA = 1e-3 / (len(PROPOSERS) * NUM_OUT)  # Bonferroni over the real runs' checks
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled
ENGINE_OPTIONS = dict(
    speculative={  # drafts in every batch, whatever they cost (module-scoped: no conftest patch)
        "method": "ngram",
        "num_speculative_tokens": K,
        "disable_batch_size": 10**6,
        "cost_aware": False,
    },
    block_size=4,
    num_blocks=400,  # 256 requests need up to ~770: some are preempted and recomputed
    max_num_seqs=256,
    max_num_batched_tokens=1030,  # drafts are never cut; new prompts are chunked beside them
)

Verifier = Callable[..., VerifyOutput]


@dataclass
class Run:
    outputs: np.ndarray  # [NUM_REQUESTS, NUM_OUT] emitted tokens
    finals: Counter[tuple[str, int]]  # (kind, output position) of verify steps' tokens
    stats: SpecStats
    num_preemptions: int
    num_kv_checks: int  # (step, running request) pairs whose visible slots were compared
    kv_mismatches: list[str]


def run_engine(proposer: str, verify: Verifier | None = None) -> Run:
    engine = hash_engine(HashDraft(seed=7) if proposer == "hash_draft" else None, **ENGINE_OPTIONS)
    reqs = [
        engine.add_request(
            f"r{i}",
            list(PROMPT),
            SamplingParams(max_tokens=NUM_OUT, temperature=TEMPERATURE, top_k=TOP_K, seed=i),
        )
        for i in range(NUM_REQUESTS)
    ]
    finals: Counter[tuple[str, int]] = Counter()
    after_rejection: set[str] = set()
    num_kv_checks = 0
    kv_mismatches: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        if verify is not None:
            patch.setattr(runner_module, "rejection_sample", verify)
        while engine.has_unfinished():
            drafts = {r.request_id: len(r.spec_token_ids) for r in engine.scheduler.running}
            for delta in engine.step():
                rid, req = delta.request.request_id, delta.request
                first = len(req.output_token_ids) - len(delta.new_token_ids)
                if rid in after_rejection:
                    finals["after_rejection", first] += 1
                    after_rejection.discard(rid)
                if k := drafts.get(rid, 0):
                    kind = "bonus" if len(delta.new_token_ids) == k + 1 else "correction"
                    finals[kind, len(req.output_token_ids) - 1] += 1
                    if kind == "correction":
                        after_rejection.add(rid)
            engine.kv_cache.check_integrity()
            num_kv_checks += len(engine.scheduler.running)
            kv_mismatches += visible_slot_mismatches(engine)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return Run(
        np.array([r.output_token_ids for r in reqs]),
        finals,
        engine.scheduler.spec_stats,
        sum(r.metrics.num_preemptions for r in reqs),
        num_kv_checks,
        kv_mismatches,
    )


def visible_slot_mismatches(engine: EngineCore) -> list[str]:
    """Running requests whose slots at positions [0, num_computed_tokens), the ones attention
    reads next step, do not hold exactly their tokens (HashLM writes token + 1 in channel
    `position` of a slot's value)."""
    block_size = engine.kv_cache.block_size
    values = engine.runner.kv_caches[0][1].reshape(-1, MAX_LEN)  # [num_slots, MAX_LEN]
    slots: list[int] = []
    expected: list[list[float]] = []
    owners: list[str] = []
    for req in engine.scheduler.running:
        table = engine.kv_cache.block_table(req.request_id)
        for pos in range(req.num_computed_tokens):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            row = [0.0] * MAX_LEN
            row[pos] = req.all_token_ids[pos] + 1.0
            expected.append(row)
            owners.append(req.request_id)
    if not slots:
        return []
    wrong = (values[slots] != values.new_tensor(expected)).any(dim=1)
    return sorted({owners[i] for i in wrong.nonzero().squeeze(1).tolist()})


# ---------------------------------------------------------------------------------------------
# The exact distribution and the chi-square check


@functools.cache
def exact_pairs() -> list[np.ndarray]:
    """Per output position j: P(y_0) [VOCAB] for j = 0, else P(y_{j-1}, y_j) [VOCAB * VOCAB],
    summed over every prefix y_0..y_{j-2} (all VOCAB**j of them, level by level)."""
    hashes = prefix_hash(TARGET_SALT, shifted_rows([PROMPT]))  # [num_prefixes]
    weights = np.ones(1)  # [num_prefixes] probability of each prefix
    last = np.zeros(1, dtype=np.int64)  # [num_prefixes] its last token (0 for the empty one)
    tokens = np.arange(VOCAB)
    pairs = []
    for j in range(NUM_OUT):
        p = weights[:, None] * softmax(hash_logits(hashes), TEMPERATURE, TOP_K)  # [n, VOCAB]
        joint = np.zeros((VOCAB if j else 1, VOCAB))
        np.add.at(joint, last, p)
        pairs.append(joint.ravel())
        hashes = extend(np.repeat(hashes, VOCAB), np.tile(tokens, len(hashes)))
        weights, last = p.ravel(), np.tile(tokens, len(p))
    return pairs


def chi_square_pvalue(cells: np.ndarray, expected: np.ndarray) -> float:
    """Goodness of fit of cell indices to probabilities; 0 when a cell of probability 0 occurs.
    Cells expected fewer than MIN_EXPECTED times are pooled into one."""
    counts = np.bincount(cells, minlength=expected.size)
    if counts[expected == 0].sum() > 0:
        return 0.0
    want = expected * cells.size
    small = (want < MIN_EXPECTED) & (expected > 0)
    big = ~small & (expected > 0)
    observed = np.append(counts[big], counts[small].sum())
    predicted = np.append(want[big], want[small].sum())
    if not small.any():
        observed, predicted = observed[:-1], predicted[:-1]
    return float(chisquare(observed, predicted).pvalue)


def position_pvalues(outputs: np.ndarray) -> list[float]:
    """One chi-square p-value per output position (pairs of consecutive tokens, see exact_pairs)."""
    pvalues = []
    for j, expected in enumerate(exact_pairs()):
        cells = outputs[:, j] if j == 0 else outputs[:, j - 1] * VOCAB + outputs[:, j]
        pvalues.append(chi_square_pvalue(cells, expected))
    return pvalues


# ---------------------------------------------------------------------------------------------
# The real verifier


@pytest.fixture(scope="module", params=PROPOSERS)
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    yield run_engine(request.param)


def test_every_output_position_follows_the_target_distribution(run: Run) -> None:
    pvalues = position_pvalues(run.outputs)
    assert min(pvalues) > ALPHA, pvalues


def test_the_run_covers_corrections_bonus_tokens_and_tokens_after_a_rejection(run: Run) -> None:
    for kind in ("correction", "bonus", "after_rejection"):
        covered = [j for j in range(NUM_OUT) if run.finals[kind, j] >= 100]
        assert len(covered) >= 3, (kind, run.finals)
    assert 0.1 < run.stats.acceptance_rate < 0.9, run.stats
    assert run.num_preemptions > 0


def test_no_slot_of_a_rejected_token_stays_visible(run: Run) -> None:
    assert run.num_kv_checks > 10_000
    assert run.kv_mismatches == []


def test_the_slot_check_sees_a_stale_slot() -> None:
    engine = hash_engine(HashDraft(seed=7), **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=MAX_LEN - len(PROMPT), temperature=TEMPERATURE, seed=0)
    req = engine.add_request("r", list(PROMPT), params)
    engine.step()  # the prompt
    engine.step()  # the first drafts verified
    assert visible_slot_mismatches(engine) == []
    block_size = engine.kv_cache.block_size
    pos = req.num_computed_tokens - 1
    slot = engine.kv_cache.block_table("r")[pos // block_size] * block_size + pos % block_size
    values = engine.runner.kv_caches[0][1].reshape(-1, MAX_LEN)
    values[slot, pos] = (req.all_token_ids[pos] + 1) % VOCAB + 1  # another token's value
    assert visible_slot_mismatches(engine) == ["r"]
    with pytest.raises(AssertionError, match="other slots"):
        values[slot, MAX_LEN - 1] = 1.0  # what a token at a later position would write
        engine.step()


# ---------------------------------------------------------------------------------------------
# Mutated verifiers: wrappers around the real one


@dataclass(frozen=True)
class Verify:
    """The arguments of one `rejection_sample` call."""

    target_probs: Tensor  # [num_reqs, max_k + 1, vocab]
    draft_token_ids: Tensor  # [num_reqs, max_k], -1 padded
    draft_probs: Tensor | None  # [num_reqs, max_k, vocab]
    greedy: Tensor
    generators: Sequence[torch.Generator | None]

    def real(self, target_probs: Tensor | None = None) -> VerifyOutput:
        p = self.target_probs if target_probs is None else target_probs
        return rejection_sample(
            p, self.draft_token_ids, self.draft_probs, self.greedy, self.generators
        )

    @property
    def num_drafts(self) -> Tensor:  # [num_reqs]
        return (self.draft_token_ids >= 0).sum(dim=1)


def resample_from_p(v: Verify, generator: torch.Generator) -> VerifyOutput:
    """After a rejection, the token comes from p instead of the residual max(0, p - q)."""
    out = v.real()
    rows = (out.num_accepted < v.num_drafts).nonzero().squeeze(1)
    return replace_final(out, rows, v.target_probs[rows, out.num_accepted[rows]], generator)


def bonus_from_q(v: Verify, generator: torch.Generator) -> VerifyOutput:
    """When every draft is accepted, the bonus token comes from the last draft's q, not p."""
    out = v.real()
    rows = ((out.num_accepted == v.num_drafts) & (v.num_drafts > 0)).nonzero().squeeze(1)
    last = v.num_drafts[rows] - 1
    if v.draft_probs is None:
        q = F.one_hot(v.draft_token_ids[rows, last], VOCAB).float()
    else:
        q = v.draft_probs[rows, last]
    return replace_final(out, rows, q, generator)


def accept_always(v: Verify, generator: torch.Generator) -> VerifyOutput:
    """Every draft is kept (p at each draft position becomes one-hot(draft)); bonus from p."""
    one_hot = F.one_hot(v.draft_token_ids.clamp(min=0), VOCAB).to(v.target_probs.dtype)
    forced = v.target_probs.clone()
    is_draft = (v.draft_token_ids >= 0).unsqueeze(2)
    forced[:, :-1] = torch.where(is_draft, one_hot, forced[:, :-1])
    return v.real(forced)


def replace_final(
    out: VerifyOutput, rows: Tensor, probs: Tensor, generator: torch.Generator
) -> VerifyOutput:
    """`out` with the final token of `rows` drawn from `probs` [len(rows), vocab]."""
    token_ids = out.token_ids.clone()
    if rows.numel():
        drawn = torch.multinomial(probs.float(), 1, generator=generator).squeeze(1)
        token_ids[rows, out.num_accepted[rows]] = drawn
    return VerifyOutput(token_ids, out.num_accepted)


MUTANTS: dict[str, Callable[[Verify, torch.Generator], VerifyOutput]] = {
    "resample_from_p": resample_from_p,
    "bonus_from_q": bonus_from_q,
    "accept_always": accept_always,
}


def mutant_verifier(name: str) -> Verifier:
    """A drop-in `rejection_sample` that runs mutant `name`."""
    generator = torch.Generator().manual_seed(5)
    return lambda *args: MUTANTS[name](Verify(*args), generator)


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_same_check_catches_a_mutated_verifier(proposer: str, mutant: str) -> None:
    pvalues = position_pvalues(run_engine(proposer, mutant_verifier(mutant)).outputs)
    assert min(pvalues) < ALPHA, pvalues


def test_exact_pairs_are_distributions() -> None:
    for j, joint in enumerate(exact_pairs()):
        assert joint.sum() == pytest.approx(1.0, abs=1e-12), j
    assert (exact_pairs()[0] == 0).sum() == VOCAB - TOP_K
