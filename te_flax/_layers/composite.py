"""What the layers made of other layers share: the heads, dropout, attribute tables, axes.

A composite layer (attention, transformer) is a description like ``te_flax._layers.linear``'s
(``te_flax._layers.host`` says what every layer is), with ``children(...)``, the sublayers it is
made of as ``Child`` records naming each sublayer's *description type* (``LayerNormMLPDescription``,
``MultiHeadAttentionDescription``, ``DropoutDescription``...), which its ``__call__`` reaches
through ``host.layer(name)``. Each front end registers its module class for every description
type, so a reader (or a tool) follows a layer into its parts by type. Attributes a sublayer shares
with its owner are copied by one ``SharedAttributes`` table per pair, never by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from te_flax._base import checks as check

__all__ = [
    "AttentionHeads",
    "Axes",
    "DropoutDescription",
    "SharedAttributes",
    "lora_scope",
    "positive_int",
]

Initializer = Callable[..., Array]
LogicalAxes = tuple[str | None, ...]
# The default of attributes the user must give (the dataclass fields need one): checked in use.
REQUIRED: Any = None


@dataclasses.dataclass
class AttentionHeads:
    """The heads of an attention layer: the first fields of TransformerEngine's
    ``DotProductAttention`` and ``MultiHeadAttention``, in its order (a layer deriving from it
    declares its own fields after these)."""

    head_dim: int = REQUIRED
    num_attention_heads: int = REQUIRED
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0


@dataclasses.dataclass
class DropoutDescription:
    """Flax's dropout (``nn.Dropout`` / ``nnx.Dropout``) with these attributes."""

    rate: float = 0.0
    broadcast_dims: Sequence[int] = ()
    rng_collection: str = "dropout"


@dataclasses.dataclass(frozen=True)
class SharedAttributes:
    """The attributes an owner hands a sublayer: ``names`` are the same on both sides,
    ``renamed`` maps a sublayer attribute to the owner's (TE's, e.g. ``kernel_init`` from
    ``mha_kernel_init``). ``target`` is the sublayer's description type."""

    target: type
    names: tuple[str, ...]
    renamed: tuple[tuple[str, str], ...] = ()

    def copy(self, owner: object, **overrides: Any) -> dict[str, Any]:
        """The sublayer's attributes read from ``owner``, then ``overrides``."""
        attributes = {name: getattr(owner, name) for name in self.names}
        attributes.update({target: getattr(owner, source) for target, source in self.renamed})
        return {**attributes, **overrides}

    def pairs(self) -> list[tuple[str, str]]:
        """(sublayer attribute, owner attribute) for every entry."""
        return [(name, name) for name in self.names] + list(self.renamed)


def positive_int(value: object, name: str) -> int:
    return check.check_positive_int(value, name)


def rate(value: object, name: str) -> float:
    return check.check_rate(value, name)


def compute(x: Array, dtype: Any) -> Array:
    dtype = check.check_dtype(dtype, "dtype")
    return x if dtype is None else x.astype(dtype)


def float32_zeros(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
    """Zeros in float32 whatever ``dtype`` (TE keeps the attention sink in float32)."""
    del key, dtype
    return jnp.zeros(shape, jnp.float32)


def normal_fan_in() -> Initializer:
    """TE's attention kernel init: variance scaling 1.0, fan-in, normal (not truncated)."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")


class Axes:
    """Logical axes of the activations, in te_flax's vocabulary (``configs/rules``)."""

    def __init__(self, transpose_batch_sequence: bool, sequence_parallel: bool = False):
        self.transpose = transpose_batch_sequence
        self.sequence_parallel = sequence_parallel

    def _lead(self, length: str | None) -> tuple[str | None, str | None]:
        return (length, "batch") if self.transpose else ("batch", length)

    @property
    def residual(self) -> LogicalAxes:
        """[batch, seq, hidden]: the norm inputs, split over seq under SP."""
        return (*self._lead("length" if self.sequence_parallel else None), "act_embed")

    @property
    def gemm_input(self) -> LogicalAxes:  # [batch, seq, hidden], the sequence gathered
        return (*self._lead(None), "act_embed")

    @property
    def heads(self) -> LogicalAxes:  # [batch, seq, heads, head_dim]
        return (*self._lead(None), "act_heads", None)

    @property
    def context(self) -> LogicalAxes:  # [batch, seq, heads * head_dim]
        return (*self._lead(None), "act_heads")

    @property
    def mlp_hidden(self) -> LogicalAxes:  # [batch, seq, intermediate]
        return (*self._lead(None), "act_mlp")


def lora_scope(scope: object) -> tuple[bool, bool, bool]:
    """TE's ``low_rank_adaptation_scope`` -> LoRA on (qkv projections, output, MLP)."""
    scopes = {
        "none": (False, False, False),
        "all": (True, True, True),
        "qkv_proj": (True, False, False),
        "output_proj": (False, True, False),
        "mlp": (False, False, True),
        "exclude_qkv_proj": (False, True, True),
        "exclude_output_proj": (True, False, True),
        "exclude_mlp": (True, True, False),
    }
    name = "none" if scope is None else str(scope).lower()
    if name not in scopes:
        raise ValueError(
            f"low_rank_adaptation_scope must be one of {sorted(scopes)}, got {scope!r}"
        )
    return scopes[name]
