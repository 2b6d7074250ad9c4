"""Speculative-sampling verification: which draft tokens a step keeps, and the token after them.

The rule (Leviathan et al. 2023; Chen et al. 2023), per request with drafts x_0..x_{k-1} drawn
from q_0..q_{k-1} and target distributions p_0..p_k from one forward pass of the target model:

    for i in 0..k-1:
        accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
        on the first rejection, emit y ~ norm(max(0, p_i - q_i)) and stop
    if all k drafts were accepted, emit a bonus token y ~ p_k

Why the output keeps the target distribution: at position i the draft is x with probability
q(x) and is kept with probability min(1, p(x)/q(x)), so x comes out by acceptance with
probability min(q(x), p(x)). Rejection happens with probability 1 - sum min(p, q)
= sum max(0, p - q), and then x comes out with probability max(0, p(x) - q(x)) / sum max(0, p - q).
The total is min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x). The next position is verified under the
same rule given an accepted prefix, so every emitted token is distributed as the target model
would have sampled it alone. One-hot drafts (n-gram or greedy drafters) are the case q = one-hot(x):
x is kept with probability p(x), and the residual is p with x removed.

Greedy rows accept while the draft equals argmax p_i and then emit argmax p at the first mismatch
(or the bonus position): exactly the tokens plain greedy decoding would produce.

Randomness: a row with a generator draws from it only, in a fixed order (k_i uniforms, then one
exponential per vocabulary entry for the final token), so its result does not depend on the other
requests in the step nor on the padded width max_k. Rows without one share the default RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PAD_TOKEN_ID = -1


@dataclass(frozen=True)
class VerifyOutput:
    token_ids: Tensor  # [num_reqs, max_k + 1] long: accepted drafts, then the final token; -1 after
    num_accepted: Tensor  # [num_reqs] long: accepted draft tokens, 0..k_i

    @property
    def num_emitted(self) -> Tensor:
        """Tokens each row gains this step: the accepted drafts plus the corrected/bonus token."""
        return self.num_accepted + 1  # [num_reqs]


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    greedy: Tensor,
    generators: Sequence[torch.Generator | None],
) -> VerifyOutput:
    """Verify each request's drafts against the target model's processed distributions.

    target_probs: [num_reqs, max_k + 1, vocab] p at each draft position plus the bonus position,
        temperature/top-k/top-p already applied (rows sum to 1).
    draft_token_ids: [num_reqs, max_k] long; request i has k_i drafts, then -1 padding.
    draft_probs: [num_reqs, max_k, vocab] q the drafts were sampled from, or None for one-hot
        drafts (q = one-hot(draft)).
    greedy: [num_reqs] bool; greedy rows compare drafts with argmax p and draw nothing.
    generators: per row; a row's generator must live on the inputs' device.
    """
    num_reqs, max_k = draft_token_ids.shape
    vocab_size = target_probs.shape[-1]
    assert target_probs.shape == (num_reqs, max_k + 1, vocab_size), target_probs.shape
    assert draft_probs is None or draft_probs.shape == (num_reqs, max_k, vocab_size)
    assert greedy.shape == (num_reqs,) and len(generators) == num_reqs
    device = target_probs.device
    rows = torch.arange(num_reqs, device=device)  # [num_reqs]
    positions = torch.arange(max_k, device=device)  # [max_k]

    probs = target_probs.float()  # [num_reqs, max_k + 1, vocab]
    is_draft = draft_token_ids >= 0  # [num_reqs, max_k]
    num_drafts = is_draft.sum(dim=1)  # [num_reqs]
    drafts = draft_token_ids.clamp(min=0)  # [num_reqs, max_k], pads read token 0, then masked
    p_draft = probs[:, :max_k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [num_reqs, max_k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [num_reqs, max_k]
    else:
        q_draft = draft_probs.float().gather(2, drafts.unsqueeze(2)).squeeze(2)

    # Draws: unseeded rows share one batch draw; seeded rows overwrite theirs from their own
    # generator, sized by their own k_i so that the padded width max_k does not shift them.
    # Greedy seeded rows draw nothing: their placeholders (0 and 1) are never read.
    uniforms = torch.zeros(num_reqs, max_k, device=device)  # [num_reqs, max_k]
    races = torch.ones(num_reqs, vocab_size, device=device)  # [num_reqs, vocab]
    if any(g is None for g in generators):
        uniforms.uniform_()
        races.exponential_()
    if any(g is not None for g in generators):
        # One host sync for all seeded rows, not one per row.
        k_list, greedy_list = num_drafts.tolist(), greedy.tolist()
        for row, generator in enumerate(generators):
            if generator is None or greedy_list[row]:
                continue
            uniforms[row, : k_list[row]] = torch.rand(
                k_list[row], generator=generator, device=device
            )
            races[row].exponential_(generator=generator)
    # Exp(1) can draw 0, and 0 / 0 = nan would win the argmax for a zero-probability token.
    races.clamp_(min=torch.finfo(races.dtype).tiny)

    # u < p / q, written without the division: q = 0 at a draft accepts it iff p > 0.
    random_accept = uniforms * q_draft < p_draft  # [num_reqs, max_k]
    greedy_accept = drafts == probs[:, :max_k].argmax(dim=2)  # [num_reqs, max_k]
    accept = torch.where(greedy.unsqueeze(1), greedy_accept, random_accept) & is_draft
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]

    # The final token: at the first rejection from the residual, after all k_i from p_{k_i}.
    p_final = probs[rows, num_accepted]  # [num_reqs, vocab]
    rejected = num_accepted < num_drafts  # [num_reqs]
    if max_k > 0:
        at = num_accepted.clamp(max=max_k - 1)  # [num_reqs]
        if draft_probs is None:
            q_final = torch.zeros_like(p_final).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        else:
            q_final = draft_probs[rows, at].float()  # [num_reqs, vocab]
        residual = (p_final - q_final).clamp_(min=0.0)  # [num_reqs, vocab]
        # p == q leaves no residual mass (only reachable through rounding): sample p instead.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_final)
        weights = torch.where(rejected.unsqueeze(1), residual, p_final)  # [num_reqs, vocab]
    else:
        weights = p_final
    # Exponential race: argmax(w / E) samples w / sum(w) without normalising w.
    sampled = weights.div(races).argmax(dim=1)  # [num_reqs]
    final = torch.where(greedy, p_final.argmax(dim=1), sampled)  # [num_reqs]

    token_ids = torch.where(
        positions < num_accepted.unsqueeze(1), draft_token_ids, PAD_TOKEN_ID
    )  # [num_reqs, max_k]
    token_ids = torch.cat(
        [token_ids, torch.full((num_reqs, 1), PAD_TOKEN_ID, dtype=torch.long, device=device)],
        dim=1,
    ).scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))  # [num_reqs, max_k + 1]
    return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted)
