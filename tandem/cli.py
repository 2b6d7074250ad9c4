"""`tandem` command line: models, generate, serve, bench."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tandem.config import DEFAULT_MODEL

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
models_app = typer.Typer(no_args_is_help=True, help="Manage local models.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured side by side).")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
console = Console()

ModelOpt = Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")]
DtypeOpt = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
DeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="Catalogue name.")] = DEFAULT_MODEL,
) -> None:
    """Download a catalogue model into $TANDEM_HOME/models."""
    from tandem import hub

    try:
        path = hub.pull(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="NAME") from None
    console.print(f"[green]ready:[/green] {path}")


@models_app.command("list")
def models_list() -> None:
    """Show the catalogue and what is already local."""
    from tandem import hub

    table = Table("catalogue name", "source", "local")
    local = set(hub.list_local())
    for name, entry in hub.CATALOGUE.items():
        path = hub.models_dir() / entry.filename
        table.add_row(name, entry.requirement, str(path) if path in local else "-")
    console.print(table)
    others = sorted(local - {hub.models_dir() / e.filename for e in hub.CATALOGUE.values()})
    for path in others:
        console.print(f"also local: {path}")


@app.command()
def generate(
    prompt: str,
    chat: Annotated[
        bool, typer.Option(help="Wrap the prompt in the model's chat template.")
    ] = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    spec: Annotated[str | None, typer.Option(help="Speculative decoding: ngram.")] = None,
    num_spec_tokens: int = 5,
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Generate a completion with the offline engine, streamed to the terminal."""
    from tandem.engine import LLM, SamplingParams

    speculative = {"method": spec, "num_speculative_tokens": num_spec_tokens} if spec else None
    try:
        llm = LLM(model, dtype=dtype, device=device, speculative=speculative)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    try:
        params.validate(llm.engine.vocab_size)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    ids = llm.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    last = None
    for out in llm.stream(ids, params):
        sys.stdout.write(out.delta)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None and last.metrics is not None:
        m = last.metrics
        tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot else "-"
        ttft = f"{m.ttft * 1e3:.0f} ms" if m.ttft else "-"
        accepted = ""
        if m.num_draft_tokens:
            accepted = f", accepted {m.num_accepted_tokens}/{m.num_draft_tokens} drafts"
        console.print(
            f"[dim]{m.n_prompt} prompt + {m.n_out} output tokens, "
            f"TTFT {ttft}, TPOT {tpot}{accepted}, finish={last.finish_reason}[/dim]"
        )


@app.command()
def serve(
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
) -> None:
    """Start Tandem. (Until the cluster lands: the offline engine answers a demo chat.)"""
    console.print(
        "[yellow]The serving cluster is not built yet; the offline engine answers a demo chat."
        "[/yellow]"
    )
    prompt = "In one sentence, what does a language model do?"
    console.print(f"[bold]user:[/bold] {prompt}")
    generate(prompt, chat=True, max_tokens=96, model=model, dtype=dtype, device=device)


@bench_app.command("engine")
def bench_engine(
    model: ModelOpt = DEFAULT_MODEL,
    dtypes: Annotated[str, typer.Option(help="Comma-separated dtypes.")] = "float32,bfloat16",
    threads: int = 2,
    new_tokens: int = 128,
    batch: int = 16,
    rounds: int = 3,
    prompts_per_round: Annotated[
        int, typer.Option(help="Batch-1 prompts per round (the same ones every round).")
    ] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the prompt selection.")] = 0,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="A one-minute pipeline check with tiny sizes (overrides the sizes)."
        ),
    ] = False,
    json_out: Annotated[
        str | None, typer.Option("--json", help="Write results here, and a .png beside them.")
    ] = None,
) -> None:
    """Engine vs transformers `generate` side by side, with the kernel floor and bandwidth limit."""
    from tandem.bench.engine import BenchConfig, BenchError, run_engine_bench

    try:
        config = BenchConfig(
            model=model,
            dtypes=tuple(d.strip() for d in dtypes.split(",") if d.strip()),
            threads=threads,
            new_tokens=new_tokens,
            batch=batch,
            rounds=rounds,
            prompts_per_round=prompts_per_round,
            seed=seed,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if quick:
        config = config.quick()
    try:
        run_engine_bench(config, json_out, console)
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
