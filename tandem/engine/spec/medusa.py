"""Medusa heads (Cai et al. 2024): small heads on the target's last hidden state, head i guessing
the token i + 2 positions after that state's position.

After a step, the target's hidden state at position p = num_computed_tokens - 1 produced the
request's last token (position p + 1); head i maps it to a distribution over the token at
p + 2 + i:

    head_i(h) = lm_head_i(r_i,L(... r_i,1(h))),    r(x) = x + SiLU(W x + b)

Drafts form a chain: draft i is head i's token, sampled from q_i, head i's distribution processed
under the request's sampling parameters (the heads do not see each other's drafts; penalties
do), and q_i goes to the verifier, so verification stays exact. Tree drafts (several candidates
per head verified with tree attention) are not built.

Checkpoint layouts (tensor names are the state dict of Medusa's `nn.ModuleList` of
`nn.Sequential`s, which `MedusaHeads` is: `{head}.{layer}.linear.weight|bias` for the residual
blocks, `{head}.{num_layers}.weight` for a head's own LM head):

- ours (`tandem spec train --method medusa`): `config.json` with `"method": "medusa"`,
  `num_heads`, `num_layers`, `hidden_size`, `vocab_size`, `own_lm_head` and the base model
  (heads.py), weights in `model.safetensors`. The self-trained heads share the target's LM head
  (`own_lm_head: false`, only the residual blocks are stored): an own head would be
  vocab x hidden parameters each (28M for SmolLM2).
- public (FasterDecoding/Medusa, Medusa-1 heads): `config.json` with `medusa_num_heads`,
  `medusa_num_layers`, `base_model_name_or_path`; weights in `medusa_lm_head.safetensors` or
  `medusa_lm_head.pt`; every head has its own LM head. (Medusa repeats one residual block
  `medusa_num_layers` times; its state dict stores the block under each index, and we load the
  copies.)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.spec.draft_sampling import DraftChain, extend_chains
from tandem.engine.spec.draft_vocab import LMHead
from tandem.engine.spec.heads import (
    WEIGHTS_FILE,
    check_fits,
    read_config,
    save_heads,
    warn_if_other_model,
)
from tandem.engine.spec.proposer import NO_DRAFT, Draft, Proposer, StepHidden

PUBLIC_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """`num_heads` heads, each `num_layers` residual blocks and, with `own_lm_head`, a linear
    map to the vocabulary (else the target's LM head)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int,
        own_lm_head: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(
            nn.Sequential(
                *(ResBlock(hidden_size, dtype, device) for _ in range(num_layers)),
                *(
                    [nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype, device=device)]
                    if own_lm_head
                    else []
                ),
            )
            for _ in range(num_heads)
        )
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.own_lm_head = own_lm_head

    def logits(self, hidden: Tensor, lm_head: LMHead) -> Tensor:
        """hidden: [n, hidden] target states -> [num_heads, n, vocab] float32."""
        outs = torch.stack([head(hidden) for head in self])  # [num_heads, n, hidden or vocab]
        if self.own_lm_head:
            return outs.float()
        return lm_head(outs.flatten(0, 1)).view(len(self), hidden.shape[0], -1)

    def config(self) -> dict[str, object]:
        """Our config.json fields for these heads (the base model's are added by the caller)."""
        return {
            "method": "medusa",
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": len(self),
            "num_layers": self.num_layers,
            "own_lm_head": self.own_lm_head,
        }


def load_medusa(
    path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> MedusaHeads:
    """Heads in our layout or Medusa's, refused unless they fit the target."""
    path = Path(path)
    config = read_config(path)
    if "medusa_num_heads" in config:
        num_heads = config["medusa_num_heads"]
        num_layers = config.get("medusa_num_layers", 1)
        state = _public_weights(path)
        lm_head = state.get(f"0.{num_layers}.weight")
        if lm_head is None:
            raise ValueError(f"medusa heads at {path}: no tensor '0.{num_layers}.weight'")
        (vocab_size, hidden_size), own_lm_head = lm_head.shape, True
    elif config.get("method") == "medusa":
        num_heads, num_layers = config["num_heads"], config["num_layers"]
        hidden_size, vocab_size = config["hidden_size"], config["vocab_size"]
        own_lm_head = config["own_lm_head"]
        state = load_file(str(path / WEIGHTS_FILE))
        warn_if_other_model(path, config, target)
    else:
        raise ValueError(
            f"{path / 'config.json'} is neither ours (method 'medusa') "
            "nor Medusa's (medusa_num_heads)"
        )
    check_fits(path, "medusa", hidden_size, vocab_size, target.cfg)
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, own_lm_head, dtype, device)
    heads.load_state_dict(state)  # strict: every name and shape; cast to dtype on copy
    return heads.eval()


def save_medusa(heads: MedusaHeads, out: str | Path, base: dict[str, str]) -> None:
    """Our layout; `base` from `heads.base_model_fields`."""
    save_heads(Path(out), heads.state_dict(), {**heads.config(), **base})


def _public_weights(path: Path) -> dict[str, Tensor]:
    for name in PUBLIC_WEIGHTS:
        file = path / name
        if file.is_file():
            if file.suffix == ".pt":
                state: dict[str, Tensor] = torch.load(file, map_location="cpu", weights_only=True)
                return state
            return load_file(str(file))
    raise FileNotFoundError(f"medusa heads at {path}: none of {', '.join(PUBLIC_WEIGHTS)}")


class MedusaProposer(Proposer):
    def __init__(
        self, heads: MedusaHeads, lm_head: LMHead, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.heads = heads
        self.lm_head = lm_head  # shared heads' logits: the target's, or a draft vocabulary's
        self.eos_token_ids = eos_token_ids
        # request id -> (position, [hidden] its target state): for a request the scheduler
        # skipped in the last step, whose state is then not in that step's hidden states
        self._last: dict[str, tuple[int, Tensor]] = {}

    @torch.inference_mode()
    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        chains: list[DraftChain] = []
        states: list[Tensor] = []
        for req, k in batch:
            state = self._state(req, hidden)
            if state is not None:
                chains.append(DraftChain(req, min(k, len(self.heads))))
                states.append(state)
        if chains:
            logits = self.heads.logits(torch.stack(states), self.lm_head)  # [heads, n, vocab]
            for i in range(max(c.k for c in chains)):
                live = [n for n, c in enumerate(chains) if c.k > i]
                extend_chains([chains[n] for n in live], logits[i, live], self.eos_token_ids)
        drafts = {c.request.request_id: c.draft() for c in chains}
        return [drafts.get(req.request_id, NO_DRAFT) for req, _ in batch]

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def _state(self, req: Request, hidden: StepHidden | None) -> Tensor | None:
        """[hidden] the target state that produced the request's last token, if known."""
        position = req.num_computed_tokens - 1
        rows = None if hidden is None else hidden.at(req.request_id, position, position + 1)
        if rows is not None:
            self._last[req.request_id] = (position, rows[0].clone())
            return rows[0]
        last = self._last.get(req.request_id)
        return last[1] if last is not None and last[0] == position else None
