"""Rotary position embedding (RoPE) as HF Llama applies it.

Rotates the two halves of each head (the "rotate_half" layout HF checkpoints
are trained with). Frequencies come from `rope_theta`; `rope_scaling` may
stretch them, with type `linear` (every frequency / factor), `llama3`
(Llama 3.1's band-wise rescaling: low frequencies / factor, high ones kept,
a smooth blend between), `yarn` (the same idea with the bands counted in
rotations over the original context, plus a factor on cos/sin that keeps the
attention logits' size: gpt-oss, DeepSeek-V2/V3); `longrope` (Phi-3) is
longrope.py's subclass. With a `rotary_dim` below the head size only a head's
first `rotary_dim` features turn (Phi-3's partial_rotary_factor). cos/sin are
computed from the positions of each step, so there is no table to size, to
place on a device, or to outgrow.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than the original context / low_freq_factor
    are stretched by `factor`, shorter than context / high_freq_factor kept,
    and the band between interpolated linearly in context / wavelength."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    middle = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(middle, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (none for factor <= 1).
    DeepSeek also folds yarn_mscale(factor, mscale_all_dim) squared into its softmax scale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_factor(scaling: Mapping[str, Any], max_position_embeddings: int | None) -> float:
    """`factor`, or where a config leaves it None (DeepSeek's may) the context stretch itself:
    max_position_embeddings / original_max_position_embeddings."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    if max_position_embeddings is None:
        raise ValueError("yarn rope_scaling without 'factor' needs max_position_embeddings")
    return max_position_embeddings / float(scaling["original_max_position_embeddings"])


def yarn_attention_factor(scaling: Mapping[str, Any], max_position_embeddings: int | None = None) -> float:
    """The factor on cos and sin (so on every q.k logit, squared): `attention_factor` where given,
    else the ratio of the mscale and mscale_all_dim corrections where both are set (1 when they
    are equal, as in DeepSeek-V3), else the plain correction of `factor`."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any],
                  max_position_embeddings: int | None = None) -> torch.Tensor:
    """YaRN: dimensions that turn more than `beta_fast` times over the original context keep their
    frequency, those turning fewer than `beta_slow` times are divided by `factor`, and a linear
    ramp over the dimension index blends between. With `truncate` (the default) the ramp's ends
    are rounded outwards to whole dimensions; gpt-oss turns that off."""
    factor = yarn_factor(scaling, max_position_embeddings)
    context = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension index that turns `rotations` times
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / (factor * powers) * (1 - kept) + 1.0 / powers * kept


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inv_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                    max_position_embeddings: int | None = None) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, theta)
    kind = rope_type_of(scaling)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if kind not in ("default", "longrope"):  # longrope scales these in LongRopeEmbedding
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, heads, head_dim] by cos/sin [..., T, 1, rotary_dim]: the first
    rotary_dim features of each head (all of them unless the rotary is partial)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned, kept = x.split([rotary_dim, x.shape[-1] - rotary_dim], dim=-1)
        return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    batch_invariant = False  # cos / sin through batch_invariant.pointwise

    """RoPE for q and k of shape [..., T, heads, head_dim] given positions [..., T].

    A model computes `cos_sin` once per forward step and every layer applies
    it (the frequencies are the same in every layer); `forward` does both for
    one pair of tensors.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None,
                 max_position_embeddings: int | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        # float32, CPU, not a parameter
        self._inv_freq = inv_frequencies(self.rotary_dim, theta, scaling, max_position_embeddings)
        # YaRN's factor on cos/sin (1.0, and no multiply, for every other type)
        self.attention_scaling = (yarn_attention_factor(scaling, max_position_embeddings)
                                  if rope_type_of(scaling) == "yarn" else 1.0)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _frequencies(self, inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
        # The frequencies twice over ([rotary_dim]), kept per device: each angle is the same
        # product as of the half-width angles concatenated, one op a step fewer.
        key = (id(inv_freq), device)
        if key not in self._on_device:
            self._on_device[key] = inv_freq.repeat(2).to(device)
        return self._on_device[key]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., T, 1, rotary_dim] for `positions`; `attn` (the step's metadata) is read
        by rotaries whose frequencies depend on the sequence (LongRopeEmbedding)."""
        inv_freq = self._frequencies(self._inv_freq, positions.device)
        return self._cos_sin(positions.float().unsqueeze(-1) * inv_freq, dtype, self.attention_scaling)

    def _cos_sin(self, angles: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
        """cos and sin of `angles` [..., T, rotary_dim], times `scale` in float32 (yarn's or
        longrope's attention factor), then cast."""
        angles = angles.unsqueeze(-2)  # [..., T, 1, rotary_dim]
        if self.batch_invariant:
            from spmd_engine.model.layers.batch_invariant import pointwise
            cos, sin = pointwise(torch.cos, angles), pointwise(torch.sin, angles)
        else:
            cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
