"""The options several `tandem` commands share, and `--spec` as the engine's `speculative` dict.

Command modules import heavy packages (torch, the engine, the cluster) inside their commands, so
that `tandem --help` and the admin commands start in a fraction of a second.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from tandem.config import parse_speculative

console = Console()

ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        help="Key the public APIs require (Authorization: Bearer KEY; default: $TANDEM_API_KEY, "
        "which keeps it out of the process list). None: open."
    ),
]
ToolParserOpt = Annotated[
    str,
    typer.Option(
        help="How the model writes tool calls: auto (from its chat template) | hermes | "
        "llama3_json."
    ),
]
ModelOpt = Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")]
DtypeOpt = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
DeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
SpecOpt = Annotated[
    str | None,
    typer.Option(
        help="Speculative decoding: ngram | draft[:MODEL] | layerskip:N | medusa:DIR | eagle:DIR"
        " | grammar (a structured output's forced tokens only)."
    ),
]
DraftModelOpt = Annotated[str | None, typer.Option(help="--spec draft: the draft model.")]
SpecCostOpt = Annotated[
    bool,
    typer.Option(help="Draft only as far as measured step times say it pays (off: always draft)."),
]
TPOpt = Annotated[
    int,
    typer.Option(
        "--tp",
        help="Tensor-parallel ranks: the model split over this many local processes (Gloo on "
        "CPU, NCCL over this host's GPUs); must divide the attention heads and the MLP size.",
    ),
]
QuantOpt = Annotated[str | None, typer.Option(help="Weights of the linear layers: int8 | int4.")]
GroupSizeOpt = Annotated[
    int, typer.Option(help="int4: input channels per scale and zero (32 | 64 | 128 | 256).")
]
KernelRoutesOpt = Annotated[
    str,
    typer.Option(
        help="CPU kernels of the linear layers: auto (this machine's measured table, measuring "
        "what it lacks) | probe (measure again) | default | a route forced everywhere it runs "
        "(row_gemm, f_linear, quant_gemm, dequant, ...)."
    ),
]
AttentionBackendOpt = Annotated[
    str,
    typer.Option(
        help="Attention over the paged cache: auto (Triton kernels on CUDA where they apply, "
        "SDPA elsewhere) | triton | sdpa."
    ),
]
CudaGraphsOpt = Annotated[
    bool, typer.Option(help="CUDA: replay decode and verify steps as CUDA graphs.")
]
KVCacheDtypeOpt = Annotated[
    str,
    typer.Option(help="KV cache: auto (the model dtype) | int8 | fp8 (e4m3), scaled per token."),
]


def speculative_option(
    spec: str | None, draft_model: str | None, **options: Any
) -> dict[str, Any] | None:
    """`--spec METHOD[:ARG]` and `--draft-model` as the engine's `speculative` dict; None
    without --spec."""
    if not spec:
        return None
    if draft_model is not None:
        options["draft_model"] = draft_model
    try:
        return parse_speculative(spec, **options)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--spec") from None
