"""Speculative-sampling verification: emitted tokens follow the target distribution (chi-square,
with mutants the same test must catch), greedy argmax chains, padding, per-request seeds."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare
from torch import Tensor

from tandem.engine.spec.rejection import VerifyOutput, rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------------------------
# Distribution: N copies of one request in a batch, emitted tokens against the target.

NUM_SAMPLES = 100_000
K = 3
TARGET = torch.tensor(  # [K + 1, vocab] p at each draft position, then the bonus position
    [
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.05, 0.10, 0.40, 0.25, 0.15, 0.05],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.10, 0.05, 0.05, 0.30, 0.30, 0.20],
    ],
    dtype=torch.float64,
)
DRAFT = torch.tensor(  # [K + 1, vocab] q; the last row only feeds the bonus-from-q mutant
    [
        [0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
        [0.20, 0.10, 0.20, 0.20, 0.20, 0.10],
        [0.05, 0.35, 0.10, 0.20, 0.25, 0.05],
        [0.40, 0.20, 0.10, 0.10, 0.10, 0.10],
    ],
    dtype=torch.float64,
)
VOCAB = TARGET.shape[1]
# q of a draft vocabulary (spec/draft_vocab.py): no mass on the tokens outside it, here 4 and 5
SUBSET_DRAFT = DRAFT * torch.tensor([1.0, 1, 1, 1, 0, 0], dtype=torch.float64)
SUBSET_DRAFT /= SUBSET_DRAFT.sum(dim=-1, keepdim=True)
Q_OF = {"draft_probs": DRAFT, "subset_probs": SUBSET_DRAFT}  # the cases with draft probabilities
CASES = ("draft_probs", "subset_probs", "one_hot")
MUTANTS = ("residual_from_p", "bonus_from_q", "always_accept")
# K + 1 "position j | first j accepted" and K "correction | first rejection at j" checks per
# case, plus one check per mutant: alpha = 1e-3 over the whole file, Bonferroni.
NUM_CHI_SQUARE_TESTS = len(CASES) * (2 * K + 1) + len(CASES) * len(MUTANTS)
ALPHA = 1e-3 / NUM_CHI_SQUARE_TESTS
MIN_SAMPLES = 500  # at least 25 expected in the rarest (p = 0.05) cell


@dataclass(frozen=True)
class Trial:
    drafted_from: Tensor  # [K + 1, vocab] float64: the distribution each draft was sampled from
    draft_probs: Tensor | None  # [N, K, vocab] what the verifier is told q is; None = one-hot
    drafts: Tensor  # [N, K] long
    out: VerifyOutput


def run_trial(case: str) -> Trial:
    drafting = torch.Generator().manual_seed(1234)
    # One-hot drafts are accepted with probability sum p q only: draft from a closer mixture.
    drafted_from = Q_OF.get(case, 0.5 * (DRAFT + TARGET))
    drafts = torch.multinomial(
        drafted_from[:K].float(), NUM_SAMPLES, replacement=True, generator=drafting
    ).T.contiguous()  # [N, K]
    target_probs = TARGET.float().expand(NUM_SAMPLES, K + 1, VOCAB)
    draft_probs = None
    if case in Q_OF:
        draft_probs = drafted_from[:K].float().expand(NUM_SAMPLES, K, VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        out = rejection_sample(
            target_probs,
            drafts,
            draft_probs,
            torch.zeros(NUM_SAMPLES, dtype=torch.bool),
            [None] * NUM_SAMPLES,
        )
    return Trial(drafted_from, draft_probs, drafts, out)


@pytest.fixture(scope="module", params=CASES)
def trial(request: pytest.FixtureRequest) -> Iterator[Trial]:
    yield run_trial(request.param)


def expected_correction(trial: Trial, j: int) -> Tensor:
    """Distribution of the token emitted at a first rejection at j: [vocab] float64.

    Sum over drafts x of P(draft x) * P(reject x) * norm(max(0, p - q_x)), q_x = q or one-hot(x).
    """
    p = TARGET[j]
    weights = torch.zeros(VOCAB, dtype=torch.float64)
    one_hot = torch.eye(VOCAB, dtype=torch.float64)
    for x in range(VOCAB):
        q = trial.drafted_from[j] if trial.draft_probs is not None else one_hot[x]
        if trial.drafted_from[j, x] == 0:
            continue  # never drafted
        reject = 1 - min(1.0, float(p[x] / q[x]))
        residual = (p - q).clamp(min=0)
        weights += trial.drafted_from[j, x] * reject * residual / residual.sum()
    return weights / weights.sum()


def chi_square_pvalue(tokens: Tensor, expected: Tensor) -> float:
    """Goodness of fit of `tokens` to `expected`; 0 when a token of probability 0 shows up."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = expected > 0
    if counts[~support].sum() > 0 or tokens.min() < 0:
        return 0.0
    result = chisquare(counts[support].numpy(), (expected[support] * tokens.numel()).numpy())
    return float(result.pvalue)


def distribution_checks(trial: Trial, token_ids: Tensor, num_accepted: Tensor) -> dict[str, float]:
    """p-values by check name; a check with under MIN_SAMPLES samples is left out."""
    samples: dict[str, tuple[Tensor, Tensor]] = {}
    for j in range(K + 1):
        # Given the drafts before j were kept, the token at j (draft kept or correction or, at
        # j = K, bonus) is what the target alone samples: p_j. j = 0 is the marginal over
        # accept and reject.
        samples[f"position {j} | first {j} accepted"] = (token_ids[num_accepted >= j, j], TARGET[j])
    for j in range(K):
        samples[f"correction | first rejection at {j}"] = (
            token_ids[num_accepted == j, j],
            expected_correction(trial, j),
        )
    return {
        name: chi_square_pvalue(tokens, expected)
        for name, (tokens, expected) in samples.items()
        if tokens.numel() >= MIN_SAMPLES
    }


def test_emitted_tokens_follow_the_target_distribution(trial: Trial) -> None:
    out = trial.out
    pvalues = distribution_checks(trial, out.token_ids, out.num_accepted)
    assert len(pvalues) == 2 * K + 1
    assert min(pvalues.values()) > ALPHA, pvalues
    # Kept drafts are the drafts; everything after the final token is padding.
    positions = torch.arange(K + 1)
    kept = positions[:K] < out.num_accepted.unsqueeze(1)
    assert torch.equal(out.token_ids[:, :K][kept], trial.drafts[kept])
    assert bool((out.token_ids[positions > out.num_accepted.unsqueeze(1)] == -1).all())


def sample(probs: Tensor, num: int, seed: int) -> Tensor:  # [num] long from probs [vocab]
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs.float(), num, replacement=True, generator=generator)


def residual_from_p(trial: Trial) -> tuple[Tensor, Tensor]:
    """Mutant: after a rejection at j, resample from p_j instead of the residual."""
    token_ids, num_accepted = trial.out.token_ids.clone(), trial.out.num_accepted
    for j in range(K):
        rows = (num_accepted == j).nonzero().squeeze(1)
        token_ids[rows, j] = sample(TARGET[j], rows.numel(), seed=j)
    return token_ids, num_accepted


def bonus_from_q(trial: Trial) -> tuple[Tensor, Tensor]:
    """Mutant: the bonus token comes from the drafter's distribution, not the target's."""
    token_ids, num_accepted = trial.out.token_ids.clone(), trial.out.num_accepted
    rows = (num_accepted == K).nonzero().squeeze(1)
    token_ids[rows, K] = sample(trial.drafted_from[K], rows.numel(), seed=7)
    return token_ids, num_accepted


def always_accept(trial: Trial) -> tuple[Tensor, Tensor]:
    """Mutant: every draft is kept, then a correct bonus token."""
    bonus = sample(TARGET[K], NUM_SAMPLES, seed=8).unsqueeze(1)
    return torch.cat([trial.drafts, bonus], dim=1), torch.full((NUM_SAMPLES,), K)


MUTANT_FUNCTIONS: dict[str, tuple[Callable[[Trial], tuple[Tensor, Tensor]], str]] = {
    "residual_from_p": (residual_from_p, "position 0 | first 0 accepted"),
    "bonus_from_q": (bonus_from_q, f"position {K} | first {K} accepted"),
    "always_accept": (always_accept, "position 0 | first 0 accepted"),
}
assert tuple(MUTANT_FUNCTIONS) == MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_chi_square_test_catches_mutants(trial: Trial, mutant: str) -> None:
    mutate, check = MUTANT_FUNCTIONS[mutant]
    pvalues = distribution_checks(trial, *mutate(trial))
    assert pvalues[check] < ALPHA, pvalues


# ---------------------------------------------------------------------------------------------
# Exact, scripted cases.


def peaked(token_ids: list[int], vocab_size: int = 8) -> Tensor:
    """[len(token_ids), vocab] distributions whose argmax is each token, with mass elsewhere."""
    probs = torch.full((len(token_ids), vocab_size), 0.5 / (vocab_size - 1))
    probs[torch.arange(len(token_ids)), token_ids] = 0.5
    return probs


def pad(rows: list[list[int]], width: int) -> Tensor:  # [len(rows), width] long, -1 padded
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_follow_the_argmax_chain(with_draft_probs: bool) -> None:
    chain = [3, 1, 4, 5]  # argmax p at positions 0..3 for every row
    drafts = [[3, 1, 4], [3, 2, 4], [0, 1, 4], [3], [], [3, 6]]
    target_probs = peaked(chain).expand(len(drafts), 4, 8)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.rand(len(drafts), 3, 8, generator=torch.Generator().manual_seed(0))
        draft_probs = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
    generators = [torch.Generator().manual_seed(row) for row in range(len(drafts))]
    states = [g.get_state() for g in generators]
    out = rejection_sample(
        target_probs,
        pad(drafts, 3),
        draft_probs,
        torch.ones(len(drafts), dtype=torch.bool),
        [None, *generators[1:]],
    )
    assert out.num_accepted.tolist() == [3, 1, 0, 1, 0, 1]
    assert out.token_ids.tolist() == [
        [3, 1, 4, 5],
        [3, 1, -1, -1],
        [3, -1, -1, -1],
        [3, 1, -1, -1],
        [3, -1, -1, -1],
        [3, 1, -1, -1],
    ]
    assert out.num_emitted.tolist() == [4, 2, 1, 2, 1, 2]
    # Greedy rows draw nothing from their generators.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_certain_accepts_and_rejects_with_different_k(with_draft_probs: bool) -> None:
    """p(draft) = 1 always accepts and p(draft) = 0 always rejects, whatever q and the draws."""
    eye = torch.eye(8)
    target_probs = torch.stack(
        [
            eye[[0, 1, 2, 5]],  # k = 3, every draft certain: bonus 5
            eye[[6, 4, 0, 0]],  # k = 1, certain: bonus from p_1 = 4
            eye[[7, 3, 0, 0]],  # k = 2, draft 1 has p = 0: residual of one-hot p_1 is 3
            eye[[2, 0, 0, 0]],  # k = 0: token from p_0
        ]
    )  # [4, 4, 8]
    drafts = pad([[0, 1, 2], [6], [7, 1], []], 3)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.full((4, 3, 8), 1 / 8)
    for seed in range(5):
        generators = [torch.Generator().manual_seed(seed), None, None, None]
        out = rejection_sample(
            target_probs, drafts, draft_probs, torch.zeros(4, dtype=torch.bool), generators
        )
        assert out.num_accepted.tolist() == [3, 1, 1, 0]
        assert out.token_ids.tolist() == [
            [0, 1, 2, 5],
            [6, 4, -1, -1],
            [7, 3, -1, -1],
            [2, -1, -1, -1],
        ]


def test_residual_without_mass_falls_back_to_p() -> None:
    # q(draft) = 0 = p(draft) rejects, and p == q leaves max(0, p - q) empty.
    num = 2000
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    out = rejection_sample(
        p.expand(num, 2, 4),
        torch.full((num, 1), 2),
        p.expand(num, 1, 4),
        torch.zeros(num, dtype=torch.bool),
        [torch.Generator().manual_seed(row) for row in range(num)],
    )
    assert bool((out.num_accepted == 0).all())
    counts = torch.bincount(out.token_ids[:, 0], minlength=4).tolist()
    assert counts[2:] == [0, 0] and min(counts[:2]) > 800, counts
    assert bool((out.token_ids[:, 1] == -1).all())


def test_no_drafts_samples_from_p() -> None:
    out = rejection_sample(
        peaked([2, 5]).unsqueeze(1),  # [2, 1, 8]
        torch.empty(2, 0, dtype=torch.long),
        None,
        torch.tensor([True, False]),
        [None, torch.Generator().manual_seed(0)],
    )
    assert out.num_accepted.tolist() == [0, 0]
    assert out.token_ids.shape == (2, 1) and out.token_ids[0, 0] == 2


# ---------------------------------------------------------------------------------------------
# Seeded rows: a row's result depends on its seed and inputs only.


def random_row(k: int, max_k: int, seed: int, vocab_size: int = 16) -> tuple[Tensor, ...]:
    """A request's target probs [max_k + 1, vocab], drafts [max_k], draft probs [max_k, vocab]."""
    generator = torch.Generator().manual_seed(seed)
    target = (2 * torch.randn(max_k + 1, vocab_size, generator=generator)).softmax(dim=-1)
    draft = (2 * torch.randn(max_k, vocab_size, generator=generator)).softmax(dim=-1)
    draft = 0.5 * draft + 0.5 * target[:max_k]  # close enough that drafts get accepted
    drafts = torch.multinomial(draft, 1, generator=generator).squeeze(1)
    drafts[k:] = -1
    return target, drafts, draft


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_a_seeded_row_does_not_depend_on_the_batch(with_draft_probs: bool) -> None:
    k, wide = 2, 4
    outcomes = set()
    for seed in range(30):
        target, drafts, draft = random_row(k, k, seed=1000 + seed)
        alone = rejection_sample(
            target.unsqueeze(0),
            drafts.unsqueeze(0),
            draft.unsqueeze(0) if with_draft_probs else None,
            torch.tensor([False]),
            [torch.Generator().manual_seed(seed)],
        )

        # The same request (padded to the wider max_k) as row 2 of a mixed batch.
        rows = [random_row(kk, wide, seed=s) for kk, s in [(4, 1), (1, 2), (0, 3), (3, 4)]]
        wide_target = torch.cat([target, torch.full((wide - k, 16), 1 / 16)])
        wide_drafts = torch.cat([drafts, torch.full((wide - k,), -1)])
        wide_draft = torch.cat([draft, torch.full((wide - k, 16), 1 / 16)])
        rows.insert(2, (wide_target, wide_drafts, wide_draft))
        target_probs, draft_ids, draft_probs = (torch.stack(t) for t in zip(*rows, strict=True))
        batch = rejection_sample(
            target_probs,
            draft_ids,
            draft_probs if with_draft_probs else None,
            torch.tensor([False, True, False, False, False]),
            [
                None,
                torch.Generator().manual_seed(77),
                torch.Generator().manual_seed(seed),
                torch.Generator().manual_seed(seed + 1),
                None,
            ],
        )

        num_accepted = int(alone.num_accepted[0])
        outcomes.add(num_accepted)
        assert int(batch.num_accepted[2]) == num_accepted
        assert batch.token_ids[2, : k + 1].tolist() == alone.token_ids[0].tolist()
        assert batch.token_ids[2, k + 1 :].tolist() == [-1] * (wide - k)
    assert outcomes == {0, 1, 2}  # rejections at each position and full acceptance were seen
