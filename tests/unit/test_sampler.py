"""Sampler: greedy, seeded reproducibility, filters against a reference, frequencies, penalties,
min_tokens and logprobs."""

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from transformers import RepetitionPenaltyLogitsProcessor

from tandem.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    processed_probs,
    request_generator,
)
from tandem.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64
EOS = 7


pytestmark = pytest.mark.usefixtures("one_thread")


def build(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        generators if generators is not None else [request_generator(p.seed, CPU) for p in params],
        prompt_ids if prompt_ids is not None else [[1, 2, 3]] * n,
        output_ids if output_ids is not None else [[]] * n,
        vocab_size,
        CPU,
        eos_token_ids=[EOS],
    )


def assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    # torch.testing.assert_close costs a second of imports on first use.
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), (actual, expected)


def random_logits(num_reqs: int, vocab_size: int = VOCAB, seed: int = 0) -> Tensor:
    return 3 * torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(seed))


def reference_probs(logits: Sequence[float], p: SamplingParams, tol: float = 0.0) -> Tensor:
    """Temperature, top-k, top-p, min-p (HF order) in float64, one token at a time; `tol` widens
    the top-p and min-p cut-offs so the kept set is a superset under float32 rounding."""
    x = torch.tensor(logits, dtype=torch.float64) / p.temperature  # [vocab]
    keep = torch.ones(len(x), dtype=torch.bool)
    if 0 < p.top_k < len(x):
        keep &= x >= x.sort(descending=True).values[p.top_k - 1]
    probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.top_p < 1.0:
        above = torch.stack([probs[probs > q].sum() for q in probs])  # mass of likelier tokens
        keep &= above < p.top_p + tol
    probs = probs * keep
    if p.min_p > 0.0:
        keep &= probs >= (p.min_p - tol) * probs.max()
    probs = probs * keep
    return probs / probs.sum()


def test_all_greedy_batch_is_argmax_and_builds_no_tensors() -> None:
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)] * 8
    logits = random_logits(8)
    batch = build(params)
    assert batch.all_greedy and not batch.seeded_rows
    unused: list[object] = [batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.greedy]
    unused += [batch.output_counts, batch.prompt_mask, batch.banned, batch.max_num_logprobs]
    assert all(t is None for t in unused)
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax_and_one_hot() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3)] * 4
    logits = random_logits(8)
    batch = build(params)
    probs = processed_probs(logits, batch)
    assert_close(probs.sum(-1), torch.ones(8))
    greedy_rows = logits[::2].argmax(-1)
    assert torch.equal(probs[::2].argmax(-1), greedy_rows)
    assert torch.equal(probs[::2].amax(-1), torch.ones(4))
    for step in range(20):
        torch.manual_seed(step)
        assert torch.equal(Sampler()(logits, batch).token_ids[::2], greedy_rows)


def run_request_in_batches(
    target: SamplingParams, others: Sequence[SamplingParams], row: int, steps: int
) -> list[int]:
    """Decode `steps` tokens with `target` at `row` among `others`; return the target's tokens."""
    params = [*others[:row], target, *others[row:]]
    generators = [request_generator(p.seed, CPU) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    keys = list(range(1, len(params)))
    keys.insert(row, 0)  # the target's logits are the same wherever it sits
    for step in range(steps):
        # Each request sees logits of its own, fixed per (request, step), like a real model.
        logits = torch.cat([random_logits(1, seed=1000 * key + step) for key in keys])
        batch = build(params, output_ids=outputs, generators=generators)
        for out, token in zip(outputs, Sampler()(logits, batch).token_ids.tolist(), strict=True):
            out.append(token)
    return outputs[row]


def test_seeded_request_gives_the_same_tokens_in_any_batch() -> None:
    target = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, seed=7)
    alone = run_request_in_batches(target, [], row=0, steps=20)
    mixes = [
        [SamplingParams(seed=s, temperature=1.0 + s / 10) for s in range(7)],
        [SamplingParams(min_p=0.1)] * 3 + [SamplingParams(temperature=0.0)] * 4,
        [SamplingParams(seed=7, top_p=0.5, presence_penalty=1.0), SamplingParams(logprobs=3)] * 3
        + [SamplingParams(temperature=0.0, seed=1)],
    ]
    for others, row in zip(mixes, (0, 3, 7), strict=True):
        assert run_request_in_batches(target, others, row, steps=20) == alone
        assert run_request_in_batches(target, others, 7 - row, steps=20) == alone
    assert len(set(alone)) > 5  # the request really samples


def test_unseeded_rows_differ_between_draws() -> None:
    logits = torch.zeros(1, VOCAB)
    batch = build([SamplingParams()])
    assert len({int(Sampler()(logits, batch).token_ids) for _ in range(20)}) > 1


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.1, 2.0),
    top_k=st.integers(-1, 12),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True),
            sampling_params,
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**32),
)
def test_filters_never_emit_a_masked_token(
    rows: list[tuple[list[int], SamplingParams]], seed: int
) -> None:
    vocab_size = 12
    # Distinct quarter-integers: no ties, so the kept set is unambiguous. Padding is never kept.
    logits = torch.full((len(rows), vocab_size), -1e4)
    allowed, likely = [], []
    for row, (values, p) in enumerate(rows):
        logits[row, : len(values)] = torch.tensor(values) / 4
        allowed.append(reference_probs(logits[row].tolist(), p, tol=1e-4) > 0)
        likely.append(reference_probs(logits[row].tolist(), p) > 1e-5)
    params = [p for _, p in rows]

    batch = build(params, vocab_size=vocab_size)
    probs = processed_probs(logits, batch)
    assert_close(probs.sum(-1), torch.ones(len(rows)))
    for row in range(len(rows)):
        assert not probs[row][~allowed[row]].any()
        assert (probs[row][likely[row]] > 0).all()

    generator = torch.Generator().manual_seed(seed)
    for _ in range(10):
        batch = build(params, generators=[generator] * len(rows), vocab_size=vocab_size)
        tokens = Sampler()(logits, batch).token_ids.tolist()
        assert all(allowed[row][t] for row, t in enumerate(tokens))


def test_processed_probs_match_the_reference() -> None:
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=1.5, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(top_k=1),
        SamplingParams(top_k=VOCAB),
    ]
    logits = random_logits(len(params), seed=3)
    probs = processed_probs(logits, build(params))
    for row, p in enumerate(params):
        expected = reference_probs(logits[row].tolist(), p).float()
        assert_close(probs[row], expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_match_the_processed_distribution(seeded: bool) -> None:
    num_samples, vocab_size = 20_000, 6
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.97, min_p=0.02, seed=0 if seeded else None)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, 3.0]]).expand(num_samples, vocab_size)
    expected = reference_probs(logits[0].tolist(), p)
    generators = [torch.Generator().manual_seed(i) for i in range(num_samples)] if seeded else None
    batch = build([p] * num_samples, generators=generators, vocab_size=vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler()(logits, batch).token_ids
    freqs = torch.bincount(tokens, minlength=vocab_size).double() / num_samples
    assert (expected == 0).sum() >= 1  # the filters cut something
    assert (freqs[expected == 0] == 0).all()
    sigma = (expected * (1 - expected) / num_samples).sqrt()
    assert ((freqs - expected).abs() <= 5 * sigma).all(), (freqs, expected)


def test_repetition_penalty_matches_transformers() -> None:
    penalties = [1.0, 1.3, 0.7, 2.0]
    prompts = [[1, 2, 3, 3], [4, 5, 9], [0, 1], [10]]
    outputs = [[5, 6], [9, 9, 11], [], [10, 12, 12]]
    logits = random_logits(4)
    batch = build(
        [SamplingParams(repetition_penalty=r) for r in penalties],
        prompt_ids=prompts,
        output_ids=outputs,
    )
    penalized = apply_penalties(logits, batch)
    for row, r in enumerate(penalties):
        history = torch.tensor([prompts[row] + outputs[row]])  # [1, num_tokens]
        expected = RepetitionPenaltyLogitsProcessor(r)(history, logits[row : row + 1].clone())
        assert_close(penalized[row], expected[0])


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(presence_penalty=-1.0),
    ]
    prompts = [[1, 2, 3], [1, 2], [8]]
    outputs = [[3, 4, 4, 4], [4, 4], [8, 9]]
    logits = random_logits(3)
    original = logits.clone()
    penalized = apply_penalties(logits, build(params, prompt_ids=prompts, output_ids=outputs))
    assert torch.equal(logits, original)  # the model's logits are not modified in place
    expected = logits.clone()
    for row, p in enumerate(params):
        for token, count in Counter(outputs[row]).items():
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    assert_close(penalized, expected)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    logits[:, 30] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    early = build(params, output_ids=[[1]] * 3)
    assert Sampler()(logits, early).token_ids.tolist() == [30, EOS, 20]
    done = build(params, output_ids=[[1, 2]] * 3)
    assert Sampler()(logits, done).token_ids.tolist() == [EOS, EOS, EOS]


def test_logprobs_are_the_raw_log_softmax() -> None:
    params = [
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(logprobs=5, top_k=2, seed=1),
    ]
    logits = random_logits(4).to(torch.bfloat16)
    batch = build(params, output_ids=[[0, 1, 2]] * 4)
    out = Sampler()(logits, batch)
    assert out.logprobs is not None
    raw = logits.float().log_softmax(-1)
    lists = out.logprobs.to_lists(batch.num_logprobs)
    assert lists[1] is None
    for row, n in ((0, 3), (2, 0), (3, 5)):
        entry = lists[row]
        assert entry is not None
        token = int(out.token_ids[row])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
        assert entry.rank == int((raw[row] > raw[row, token]).sum()) + 1
        top = raw[row].topk(n)
        assert list(entry.top_token_ids) == top.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-6)


def test_tiny_top_p_keeps_the_most_likely_token() -> None:
    params = [SamplingParams(top_p=1e-9), SamplingParams(top_p=1e-9, top_k=3)] * 8
    logits = random_logits(len(params), seed=5)
    probs = processed_probs(logits, build(params))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.amax(-1), torch.ones(len(params)))


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw() -> None:
    logits = random_logits(3)
    unlikely, likely = int(logits[0].argmin()), int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0.0, logprobs=0, logit_bias=((unlikely, 100.0),)),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias=((likely, -100.0), (3, 0.5))),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, build(params))
    tokens = out.token_ids.tolist()
    assert tokens[0] == unlikely and tokens[1] != likely
    assert tokens[2] == int(logits[2].argmax())
    assert out.logprobs is not None
    raw = logits.log_softmax(dim=-1)
    assert_close(out.logprobs.logprobs[:, 0], raw[torch.arange(3), out.token_ids])


@pytest.mark.parametrize(
    ("bias", "message"), [(((VOCAB, 1.0),), "token ids"), (((1, 100.5),), "values")]
)
def test_logit_bias_out_of_range_names_the_field(bias: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=f"^logit_bias {message}"):
        SamplingParams(logit_bias=bias).validate(VOCAB)
