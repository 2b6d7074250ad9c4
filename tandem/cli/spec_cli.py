"""`tandem spec train`: its options; the recipe is in tandem/training/distill.py."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from tandem.config import DEFAULT_MODEL
from tandem.data import SPECBENCH_PATH


def spec_train(
    method: Annotated[str, typer.Option(help="eagle | medusa | draft")],
    out: Annotated[str, typer.Option(help="Directory for the weights, config.json and report.")],
    model: Annotated[
        str, typer.Option(help="The target: catalogue name, HF directory or .gguf path.")
    ] = DEFAULT_MODEL,
    minutes: Annotated[
        float, typer.Option(help="Wall-clock budget of corpus and training (evaluation after).")
    ] = 5.0,
    prompts: Annotated[
        str, typer.Option(help="Spec-Bench JSONL: the first turn of each question.")
    ] = str(SPECBENCH_PATH),
    seed: int = 0,
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    threads: Annotated[int | None, typer.Option(help="torch threads on CPU.")] = None,
    num_heads: Annotated[int, typer.Option(help="medusa: heads.")] = 4,
    draft_layers: Annotated[int, typer.Option(help="draft: the target's first layers.")] = 4,
) -> None:
    """Self-distill draft heads (or a draft model) from the target and report the acceptance
    they reach on held-out prompts."""
    from tandem.training.distill import TrainConfig, train

    try:
        config = TrainConfig(
            method=method,
            out=out,
            model=model,
            minutes=minutes,
            seed=seed,
            device=device,
            num_threads=threads,
            num_heads=num_heads,
            draft_layers=draft_layers,
            prompts=prompts,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    train(config, Console())
