"""Rotary position embeddings (RoPE), with the scaling variants Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.engine import layer_ops


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after `rope_scaling` if the config has one."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    else:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3"
        )
    return inv_freq.float()


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (HF's rotate-half convention)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim]
        """The step's tables, looked up once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated; on CPU with the native extension, in place (one call for both, float32
    arithmetic, `csrc/layer_ops.cpp`), else by torch ops into new tensors."""
    cos, sin = cos_sin
    n, d = q.shape[0], q.shape[-1]
    # [n, heads * d] views of q and k, a cos / sin row per token
    fits = q.stride(-2) == d and k.stride(-2) == d and cos.shape[0] == sin.shape[0] == n > 0
    ext = layer_ops.extension_for(q, k, cos, sin) if fits and q.dtype == k.dtype else None
    if ext is not None:
        ext.rotary(
            q.view(n, q.shape[1] * d), k.view(n, k.shape[1] * d), cos.view(n, d), sin.view(n, d), d
        )
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
