"""`tandem generate`: one completion from the offline engine, streamed to the terminal."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from tandem.cli.options import (
    AttentionBackendOpt,
    CudaGraphsOpt,
    DeviceOpt,
    DraftModelOpt,
    DtypeOpt,
    GroupSizeOpt,
    KernelRoutesOpt,
    KVCacheDtypeOpt,
    ModelOpt,
    QuantOpt,
    SpecCostOpt,
    SpecOpt,
    TPOpt,
    console,
    speculative_option,
)
from tandem.config import DEFAULT_MODEL

if TYPE_CHECKING:
    from tandem.engine import LLM


def generate(
    prompt: str,
    chat: Annotated[
        bool, typer.Option(help="Wrap the prompt in the model's chat template.")
    ] = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    num_spec_tokens: int = 5,
    spec_cost_aware: SpecCostOpt = True,
    quantization: QuantOpt = None,
    quant_group_size: GroupSizeOpt = 32,
    kernel_routes: KernelRoutesOpt = "auto",
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    kv_cache_dtype: KVCacheDtypeOpt = "auto",
    attention_backend: AttentionBackendOpt = "auto",
    cuda_graphs: CudaGraphsOpt = True,
    tp: TPOpt = 1,
) -> None:
    """Generate a completion with the offline engine, streamed to the terminal."""
    from tandem.engine import LLM

    speculative = speculative_option(
        spec, draft_model, num_speculative_tokens=num_spec_tokens, cost_aware=spec_cost_aware
    )
    try:
        llm = LLM(
            model,
            dtype=dtype,
            device=device,
            speculative=speculative,
            quantization=quantization,
            quant_group_size=quant_group_size,
            kernel_routes=kernel_routes,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            tensor_parallel_size=tp,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        _stream(llm, prompt, chat, max_tokens, temperature, top_p, seed)
    finally:
        llm.close()


def _stream(
    llm: LLM,
    prompt: str,
    chat: bool,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
) -> None:
    from tandem.engine import SamplingParams

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
