"""`tandem spec train`: draft heads (Medusa, EAGLE) or a draft model, self-distilled from the
target on CPU (or any device) within a time budget.

1. Corpus (up to `CORPUS_SHARE` of the budget): the first turn of each Spec-Bench question as a
   chat, a few held out; the target generates greedily from the others with the engine, and its
   final (normed) hidden state at every position is recorded while it generates (no second pass;
   prefix caching is off so that every prompt position is computed). The teacher distribution at
   position j, p_j = softmax(lm_head(h_j)), is recomputed from h_j when a loss needs it.
2. Training (until `TRAIN_SHARE` of the budget), on every position of the corpus:
   - medusa: head i on h_j against p_{j+i+1}, the target's distribution of token j + i + 2; soft
     cross-entropy weighted 0.8^i; residual blocks start at zero, so each head starts as the
     target's LM head (as Medusa's do) and shares it (`own_lm_head: false`).
   - eagle: windows of pairs (h_j, x_{j+1}); smooth L1 of the feature f_j against h_{j+1} plus
     0.1 x soft cross-entropy of lm_head(f_j) against p_{j+1} (EAGLE-1's losses and weights).
   - draft: the target's first `draft_layers` layers with its norm and (tied) LM head, fine-tuned
     on windows with soft cross-entropy against p_j (the KL divergence up to a constant); saved as
     a Hugging Face directory (config.json, model.safetensors, tokenizer) for `method=draft`.
3. Evaluation: the engine with the result, greedy, on the held-out prompts, one batch; mean
   acceptance length and per-position acceptance from `engine.scheduler.spec_stats`. For EAGLE
   also with the prompts' hidden states missing (a prefix-cache hit over the prompt, which is what
   a decode worker sees: its prompt KV came from a prefill worker).
4. Save: weights (safetensors) and config.json to `out`, and `train_report.json` beside them;
   and the corpus's tokens ranked by count (`draft_vocab.json`), the draft vocabulary
   (`draft_vocab.py`), which the evaluation uses too.
"""

from __future__ import annotations

import json
import math
import random
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor, nn

from tandem.config import DEFAULT_MODEL
from tandem.engine.attention import AttentionMetadata, SeqSpec, TorchSDPABackend
from tandem.engine.llm import LLM
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.spec.acceptance import SpecStats
from tandem.engine.spec.decoder import SpecDecoder
from tandem.engine.spec.draft_vocab import save_ranking
from tandem.engine.spec.eagle import EagleHead, save_eagle
from tandem.engine.spec.heads import base_model_fields, hf_config, hf_tensors, save_heads
from tandem.engine.spec.medusa import MedusaHeads, save_medusa
from tandem.engine.spec.proposer import NO_DRAFT, Draft, Proposer, StepHidden
from tandem.progress import progress_bar
from tandem.sampling_params import SamplingParams

METHODS = ("eagle", "medusa", "draft")
CORPUS_SHARE = 0.4  # of the budget, at most, for generating the corpus
TRAIN_SHARE = 0.8  # training ends here; evaluation takes the rest (it is not cut short)
REPORT_FILE = "train_report.json"
EAGLE_NOISE = 0.2  # width of the uniform noise on the head's input states (EAGLE-1's)


@dataclass(frozen=True)
class TrainConfig:
    method: str
    out: str
    prompts: str  # Spec-Bench JSONL: the first turn of each question
    model: str = DEFAULT_MODEL
    minutes: float = 5.0
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None
    num_heads: int = 4  # medusa heads
    draft_layers: int = 4  # draft: the target's first layers it keeps
    gen_tokens: int = 96  # greedy tokens generated per corpus prompt, at most
    corpus_kv_gib: float = 3.0  # KV cache of the corpus run: every prompt runs at once
    max_prompt_tokens: int = 1024  # longer prompts are left out of the corpus
    window: int = 1024  # eagle / draft: positions of a sequence a training step sees, at most
    batch_positions: int = 1024  # eagle / draft: positions per training step
    loss_rows: int = 128  # rows through the LM head per step (medusa: positions x heads)
    eval_prompts: int = 8  # held out
    eval_tokens: int = 64
    num_speculative_tokens: int = 4  # at evaluation

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not Path(self.prompts).is_file():
            raise ValueError(f"prompts: no such file {self.prompts}")
        if self.window <= 16:
            raise ValueError(f"window must be > 16 (training attention), got {self.window}")
        if self.num_heads < 1 or self.draft_layers < 1 or self.eval_prompts < 1:
            raise ValueError("num_heads, draft_layers and eval_prompts must be >= 1")


@dataclass
class Sample:
    """One corpus sequence: a prompt and the target's greedy continuation."""

    tokens: Tensor  # [T] long
    hidden: (
        Tensor  # [T - 1, hidden] float32: the target's final state at every position but the last
    )
    prompt_len: int


@dataclass
class TrainResult:
    method: str
    num_sequences: int
    num_tokens: int
    steps: int
    train_seconds: float
    final_loss: float
    acceptance: dict[str, Any] = field(default_factory=dict)
    acceptance_missing_prefix: dict[str, Any] | None = None


# --- corpus ---------------------------------------------------------------------------------


def load_questions(path: str | Path) -> list[str]:
    """The first turn of every Spec-Bench question."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row["turns"][0] for row in rows]


def prompt_ids(llm: LLM, question: str) -> list[int]:
    """The question as a one-message chat, or as plain text for a model without chat template."""
    if llm.tokenizer.chat_template is None:
        return llm.encode(question)
    return llm.apply_chat_template([{"role": "user", "content": question}])


class _HiddenRecorder(Proposer):
    """Keeps the target's hidden states of every step and drafts nothing: installed as the
    engine's proposer, it sees every position the target computes."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[int, Tensor]]] = defaultdict(list)

    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        if hidden is not None:
            for request_id, (row, first, num) in hidden.spans.items():
                rows = hidden.states[row : row + num].to(torch.float32, copy=True)
                self.chunks[request_id].append((first, rows))
        return [NO_DRAFT] * len(batch)

    def states(self, request_id: str, num_positions: int) -> Tensor:
        """[num_positions, hidden] the latest state of positions 0 .. num_positions - 1."""
        chunks = self.chunks.pop(request_id)
        out = chunks[0][1].new_zeros(num_positions, chunks[0][1].shape[1])
        for first, rows in chunks:  # a recompute after preemption rewrites the same values
            out[first : first + len(rows)] = rows[: num_positions - first]
        return out


def generate_corpus(
    llm: LLM,
    prompts: Sequence[list[int]],
    config: TrainConfig,
    deadline: float,
    progress: Callable[[int], None],
) -> list[Sample]:
    """Greedy continuations of `prompts` with the target's hidden states, until all are done or
    `deadline` (one engine step at least); then each request is kept as far as it got (a
    prompt, part of one, a partial response). All prompts run at once (as many as the engine
    seats): their prefill comes first and yields far more positions per second than decoding."""
    engine = llm.engine
    assert isinstance(engine.runner, ModelRunner)
    recorder = _HiddenRecorder()
    # The engine's proposer hook: a speculative decoder whose proposer records and drafts nothing.
    engine.spec_decoder = SpecDecoder(
        recorder, engine.config, engine.scheduler, engine.max_model_len
    )
    engine.runner.keep_hidden = True
    params = SamplingParams(max_tokens=config.gen_tokens, temperature=0.0)
    requests = [engine.add_request(f"corpus-{i}", ids, params) for i, ids in enumerate(prompts)]
    while engine.has_unfinished():  # at least one step
        progress(sum(delta.finished for delta in engine.step()))
        if time.monotonic() >= deadline:
            break
    corpus: list[Sample] = []
    for req in requests:
        num_computed = req.num_computed_tokens  # positions with a hidden state (and a next token)
        if num_computed:
            tokens = torch.tensor(req.all_token_ids[: num_computed + 1])
            hidden = recorder.states(req.request_id, num_computed)
            corpus.append(Sample(tokens, hidden, min(req.num_prompt_tokens, num_computed + 1)))
        engine.abort(req.request_id)
    engine.spec_decoder, engine.runner.keep_hidden = None, False
    return corpus


# --- training -------------------------------------------------------------------------------


class _WindowAttention(TorchSDPABackend):
    """Training attention: each window starts at its own position 0 and attends over the step's
    own keys (causal); nothing is written to a KV cache, so autograd sees plain tensors."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        assert meta.batched is None, "training windows must be longer than 16 positions"
        group = self.num_heads // self.num_kv_heads
        return torch.cat(
            [
                self._long(q[s.token_slice], k[s.token_slice], v[s.token_slice], kv_cache, s, group)
                for s in meta.long_seqs
            ]
        )


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """Mean over rows of -sum p log softmax(logits): the KL divergence up to p's entropy."""
    return -(target_probs * logits.log_softmax(dim=-1)).sum(dim=-1).mean()


class _Batches:
    """Random training positions and windows over the corpus, prompts included: prompt
    positions cost the corpus a prefill only, and with the teacher's own distributions as
    targets they teach what the responses do (a corpus of responses alone is overfit in
    minutes: 63% top-1 on it, 15% held out)."""

    def __init__(self, corpus: Sequence[Sample], config: TrainConfig, seed: int) -> None:
        self.corpus = corpus
        self.config = config
        self.rng = random.Random(seed)

    def positions(self, count: int, lookahead: int) -> tuple[Tensor, list[tuple[int, int]]]:
        """`count` (sequence, position j) with h_{j+lookahead} known, uniform over positions;
        returns the states h_j [count, hidden] and the pairs."""
        sizes = [max(0, len(seq.hidden) - lookahead) for seq in self.corpus]
        if not any(sizes):
            raise ValueError(f"no corpus sequence is longer than {lookahead + 1} tokens")
        picks = self.rng.choices(range(len(self.corpus)), weights=sizes, k=count)
        pairs = [(i, self.rng.randrange(sizes[i])) for i in picks]
        return torch.stack([self.corpus[i].hidden[j] for i, j in pairs]), pairs

    def windows(self, last: int) -> tuple[list[tuple[Sample, int, int]], Tensor]:
        """Whole sequences, positions [0, len(hidden) - last) (the last `window` of them if
        longer: the heads see the whole context when drafting), `batch_positions` in all (at
        least one sequence); and `loss_rows` rows of their concatenation, at random, the ones a
        step sends through the LM head."""
        eligible = [seq for seq in self.corpus if len(seq.hidden) - last > 16]  # attention
        if not eligible:
            raise ValueError("no corpus sequence is longer than 17 tokens")
        windows: list[tuple[Sample, int, int]] = []
        total = 0
        while total < self.config.batch_positions:
            seq = self.rng.choice(eligible)
            end = len(seq.hidden) - last
            start = max(0, end - self.config.window)
            windows.append((seq, start, end))
            total += end - start
        rows = self.rng.sample(range(total), min(total, self.config.loss_rows))
        return windows, torch.tensor(sorted(rows))


def _window_meta(
    backend: TorchSDPABackend, lengths: Sequence[int], device: torch.device
) -> AttentionMetadata:
    block_size = backend.block_size
    seqs = [SeqSpec(0, n, [0] * math.ceil(n / block_size)) for n in lengths]
    return backend.build_metadata(seqs, device)


class _Trainer(ABC):
    """One method's trainable module and its loss on a batch from `_Batches`."""

    module: nn.Module
    lr: float

    @abstractmethod
    def loss(self, batches: _Batches) -> Tensor: ...

    @abstractmethod
    def save(self, out: Path) -> None: ...


class _MedusaTrainer(_Trainer):
    lr = 1e-3

    def __init__(self, llm: LLM, config: TrainConfig) -> None:
        self.target = _target(llm)
        cfg = self.target.cfg
        device = self.target.embed_tokens.weight.device
        self.module = self.heads = MedusaHeads(
            cfg.hidden_size, cfg.vocab_size, config.num_heads, 1, False, torch.float32, device
        )
        with torch.no_grad():
            for param in self.heads.parameters():
                param.zero_()
        self.base = base_model_fields(config.model, self.target)

    def loss(self, batches: _Batches) -> Tensor:
        num_heads = len(self.heads)
        count = max(1, batches.config.loss_rows // num_heads)
        states, pairs = batches.positions(count, lookahead=num_heads)
        logits = self.heads.logits(states, self.target.compute_logits)  # [heads, n, vocab]
        total = states.new_zeros(())
        for i in range(num_heads):
            with torch.no_grad():
                ahead = torch.stack([batches.corpus[s].hidden[j + i + 1] for s, j in pairs])
                teacher = self.target.compute_logits(ahead).softmax(dim=-1)
            total = total + 0.8**i * soft_cross_entropy(logits[i], teacher)
        return total

    def save(self, out: Path) -> None:
        save_medusa(self.heads, out, self.base)


class _EagleTrainer(_Trainer):
    lr = 1e-3

    def __init__(self, llm: LLM, config: TrainConfig) -> None:
        self.target = _target(llm)
        cfg = replace(self.target.cfg, num_layers=1)
        self.device = self.target.embed_tokens.weight.device
        self.backend = _WindowAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16)
        self.module = self.head = EagleHead(
            cfg, self.backend, True, cfg.max_position_embeddings, torch.float32, self.device
        )
        self.base = base_model_fields(config.model, self.target)

    def loss(self, batches: _Batches) -> Tensor:
        # Pairs (h_j, x_{j+1}) for j in [start, end); targets h_{j+1} and p_{j+1}.
        windows, rows = batches.windows(last=1)
        dev = self.device
        tokens = torch.cat([seq.tokens[a + 1 : b + 1] for seq, a, b in windows]).to(dev)
        states = torch.cat([seq.hidden[a:b] for seq, a, b in windows]).to(dev)
        targets = torch.cat([seq.hidden[a + 1 : b + 1] for seq, a, b in windows]).to(dev)
        positions = torch.cat([torch.arange(a, b) for _, a, b in windows]).to(dev)
        meta = _window_meta(self.backend, [b - a for _, a, b in windows], dev)
        rows = rows.to(dev)
        with torch.no_grad():
            embeds = self.target.embed_tokens(tokens)
            teacher = self.target.compute_logits(targets[rows]).softmax(dim=-1)
        noise = (torch.rand_like(states) - 0.5) * EAGLE_NOISE  # drafting feeds its own features
        features = self.head(embeds, states + noise, positions, [_NO_CACHE], meta)
        regression = F.smooth_l1_loss(features, targets)
        logits = self.target.compute_logits(features[rows])
        return regression + 0.1 * soft_cross_entropy(logits, teacher)

    def save(self, out: Path) -> None:
        save_eagle(self.head, out, self.base)


class _DraftTrainer(_Trainer):
    lr = 1e-4

    def __init__(self, llm: LLM, config: TrainConfig) -> None:
        self.llm = llm
        self.target = _target(llm)
        cfg = replace(
            self.target.cfg, num_layers=min(config.draft_layers, self.target.cfg.num_layers)
        )
        self.device = self.target.embed_tokens.weight.device
        self.backend = _WindowAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16)
        self.draft = LlamaForCausalLM(cfg, self.backend, torch.float32, self.device)
        state = self.target.state_dict()
        self.draft.load_state_dict({k: state[k] for k in self.draft.state_dict()})
        self.draft.embed_tokens.requires_grad_(False)  # tied to the LM head: kept as the target's
        if self.draft.lm_head is not None:
            self.draft.lm_head.requires_grad_(False)
        self.module = self.draft

    def loss(self, batches: _Batches) -> Tensor:
        windows, rows = batches.windows(last=0)
        dev = self.device
        tokens = torch.cat([seq.tokens[a:b] for seq, a, b in windows]).to(dev)
        positions = torch.cat([torch.arange(a, b) for _, a, b in windows]).to(dev)
        meta = _window_meta(self.backend, [b - a for _, a, b in windows], dev)
        rows = rows.to(dev)
        with torch.no_grad():
            states = torch.cat([seq.hidden[a:b] for seq, a, b in windows]).to(dev)
            teacher = self.target.compute_logits(states[rows]).softmax(dim=-1)
        caches = [_NO_CACHE] * self.draft.cfg.num_layers
        hidden = self.draft(tokens, positions, caches, meta)
        return soft_cross_entropy(self.draft.compute_logits(hidden[rows]), teacher)

    def save(self, out: Path) -> None:
        """A Hugging Face model directory, tokenizer included."""
        cfg = self.draft.cfg
        save_heads(out, hf_tensors(self.draft, cfg, "model."), hf_config(cfg))
        self.llm.tokenizer.save_pretrained(str(out))


_NO_CACHE = torch.empty(0)  # training windows attend over their own keys (`_WindowAttention`)
_TRAINERS: dict[str, Callable[[LLM, TrainConfig], _Trainer]] = {
    "medusa": _MedusaTrainer,
    "eagle": _EagleTrainer,
    "draft": _DraftTrainer,
}


def _target(llm: LLM) -> LlamaForCausalLM:
    model = llm.engine.model
    assert isinstance(model, LlamaForCausalLM)
    return model


# --- evaluation -----------------------------------------------------------------------------

EVAL_NO_BATCH_LIMIT = 1 << 30  # a disable_batch_size no evaluation batch comes near


def evaluate(
    config: TrainConfig, prompts: Sequence[list[int]], missing_prefix: bool = False
) -> dict[str, Any]:
    """Greedy generation on `prompts` with the trained result; acceptance from the engine.

    `missing_prefix`: run the prompts once to fill the prefix cache, then measure a second run,
    whose prompts' full blocks are cache hits (no hidden states for them)."""
    spec: dict[str, Any] = {
        "method": config.method,
        "num_speculative_tokens": config.num_speculative_tokens,
        # All prompts run as one batch, drafting as at batch 1: acceptance is measured, not
        # speed (the device's batch-size schedule drafts nothing from 4 requests on a CPU, and
        # the cost model would draft less where drafts do not pay).
        "disable_batch_size": EVAL_NO_BATCH_LIMIT,
        "cost_aware": False,
    }
    spec["draft_model" if config.method == "draft" else "path"] = config.out
    llm = LLM(
        config.model,
        device=config.device,
        speculative=spec,
        enable_prefix_caching=missing_prefix,
        num_threads=config.num_threads,
    )
    params = SamplingParams(max_tokens=config.eval_tokens, temperature=0.0, ignore_eos=True)
    if missing_prefix:
        llm.generate(list(prompts), params)
        llm.engine.scheduler.spec_stats = SpecStats()
    start = time.monotonic()
    outs = llm.generate(list(prompts), params)
    seconds = time.monotonic() - start
    stats = llm.engine.scheduler.spec_stats
    return {
        "prompts": len(prompts),
        "tokens": sum(len(o.token_ids) for o in outs),
        "seconds": round(seconds, 2),
        "num_speculative_tokens": config.num_speculative_tokens,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "per_position": [round(r, 3) for r in stats.per_position_rates],
        "drafts": stats.num_drafts,
    }


# --- the command ----------------------------------------------------------------------------


def train(config: TrainConfig, console: Console) -> TrainResult:
    """Corpus -> training -> save -> held-out acceptance, within `config.minutes`."""
    start = time.monotonic()
    budget = config.minutes * 60
    torch.manual_seed(config.seed)
    questions = load_questions(config.prompts)
    random.Random(config.seed).shuffle(questions)
    llm = LLM(
        config.model,
        device=config.device,
        enable_prefix_caching=False,  # every prompt position must be computed (and recorded)
        max_num_seqs=len(questions),
        memory_gib=config.corpus_kv_gib,
        num_threads=config.num_threads,
    )
    prompts = [ids for q in questions if len(ids := prompt_ids(llm, q)) <= config.max_prompt_tokens]
    held_out, train_prompts = prompts[: config.eval_prompts], prompts[config.eval_prompts :]
    out = Path(config.out)
    with progress_bar(console) as progress:
        task = progress.add_task("corpus (prompts)", total=len(train_prompts))
        corpus = generate_corpus(
            llm,
            train_prompts,
            config,
            start + CORPUS_SHARE * budget,
            lambda n: progress.advance(task, n),
        )
        trainer = _TRAINERS[config.method](llm, config)
        _target(llm).requires_grad_(False)
        steps, seconds, loss = _fit(trainer, corpus, config, start + TRAIN_SHARE * budget, progress)
    trainer.save(out)
    save_ranking(out, [s.tokens for s in corpus])  # drafts score the corpus's frequent tokens
    num_tokens = sum(len(s.tokens) for s in corpus)
    console.print(
        f"{config.method}: {len(corpus)} sequences ({num_tokens} tokens), {steps} steps in "
        f"{seconds:.0f} s, final loss {loss:.3f}; saved to {out}"
    )
    result = TrainResult(config.method, len(corpus), num_tokens, steps, seconds, loss)
    result.acceptance = evaluate(config, held_out)
    _print_acceptance(console, "held-out", result.acceptance)
    if config.method == "eagle":
        result.acceptance_missing_prefix = evaluate(config, held_out, missing_prefix=True)
        _print_acceptance(
            console, "held-out, prompt hidden states missing", result.acceptance_missing_prefix
        )
    report = {"config": asdict(config), **asdict(result)}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return result


def _fit(
    trainer: _Trainer,
    corpus: Sequence[Sample],
    config: TrainConfig,
    deadline: float,
    progress: Any,
) -> tuple[int, float, float]:
    """Adam steps until `deadline` (at least one); returns steps, seconds, last loss (EMA)."""
    params = [p for p in trainer.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, weight_decay=0.0)
    batches = _Batches(corpus, config, config.seed)
    start = time.monotonic()
    total = max(1.0, deadline - start)
    task = progress.add_task(f"train {config.method}", total=int(total))
    trainer.module.train()
    steps, smoothed = 0, math.nan
    while steps == 0 or time.monotonic() < deadline:
        loss = trainer.loss(batches)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        steps += 1
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        progress.update(
            task,
            completed=min(total, time.monotonic() - start),
            description=f"train {config.method} (step {steps}, loss {smoothed:.3f})",
        )
    trainer.module.eval()
    return steps, time.monotonic() - start, smoothed


def _print_acceptance(console: Console, label: str, acceptance: dict[str, Any]) -> None:
    per_position = ", ".join(f"{r:.2f}" for r in acceptance["per_position"])
    console.print(
        f"{label}: mean acceptance length {acceptance['mean_acceptance_length']:.2f} "
        f"(k <= {acceptance['num_speculative_tokens']}, {acceptance['drafts']} drafts), "
        f"acceptance rate {acceptance['acceptance_rate']:.2f}, per position [{per_position}]"
    )
