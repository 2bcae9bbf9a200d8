"""``QuantizerFactory``: quantizers and quantizer sets with fresh state, with TransformerEngine's
signatures (``create`` and ``create_set``), from a recipe or a ``ScalingMode``."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal, cast, overload

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.checks import check_positive_int
from te_flax.quantize.autocast import get_autocast_recipe
from te_flax.quantize.grouped_quantizer import GroupedQuantizer, group_quantizer
from te_flax.quantize.quantizer_set import (
    GemmPrecision,
    QuantizerSet,
    grouped_quantizer_set,
    noop_quantizer_set,
)
from te_flax.quantize.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_recipe,
)
from te_flax.quantize.scaling_modes import (
    QuantizeLayout,
    QuantizeMeta,
    QuantizeMetaSet,
    ScalingMode,
)
from te_flax.quantize.tensor_quantizers import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    Float8BlockQuantizer,
    NVFP4Quantizer,
    Quantizer,
)

__all__ = ["QuantizerFactory"]

_DELAYED_KWARGS = ("scale", "amax_history", "margin", "amax_compute_algo")
_NVFP4_KWARGS = ("sr_key", "use_rht")


class QuantizerFactory:
    """Builds quantizers and quantizer sets with fresh state (TransformerEngine's factory)."""

    @staticmethod
    def create(
        n_quantizers: int = 1,
        scaling_mode: ScalingMode | None = None,
        q_dtype: DTypeLike | None = None,
        q_layout: QuantizeLayout | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        **kwargs: Any,
    ) -> Quantizer | GroupedQuantizer | tuple[Quantizer | GroupedQuantizer | None, ...] | None:
        """``n_quantizers`` quantizers of ``scaling_mode`` (None for ``NO_SCALING``).

        Args:
          n_quantizers: how many (default 1; more give a tuple).
          scaling_mode: a ``ScalingMode`` (required).
          q_dtype: the quantized dtype (default ``float8_e4m3fn``; ``float4_e2m1fn`` for NVFP4).
          q_layout: accepted for TransformerEngine's code and without effect: te_flax's ops
            quantize each tensor in the layouts their GEMMs contract (a ``GroupedQuantizer``
            records it).
          n_groups: None (default), or the number of groups of a grouped GEMM: then each
            quantizer is a ``GroupedQuantizer`` with one quantizer per group, as
            TransformerEngine's, for ``te_flax.dense.grouped_dense``; delayed-scaling state
            given in ``kwargs`` starts every group.
          checkpoint_name: None; te_flax names quantized operands per set
            (``create_set(checkpoint_name=...)``).
          **kwargs: the quantizer's state and options: delayed scaling takes ``scale`` (the
            quantization scale, ``1 / scale_inv``, f32[1]), ``amax_history`` (f32[L]),
            ``margin`` and ``amax_compute_algo`` (``"max"`` or ``"most_recent"``); NVFP4
            takes ``sr_key`` (stochastic rounding) and ``use_rht``.

        Example usage::

          >>> from te_flax.quantize import QuantizerFactory, ScalingMode
          >>> q = QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING)
          >>> type(q).__name__, q.scaling_mode.name
          ('CurrentScaleQuantizer', 'CURRENT_TENSOR_SCALING')
        """
        _check_count(n_quantizers, "n_quantizers")
        _check_scaling_mode(scaling_mode)
        assert isinstance(scaling_mode, ScalingMode)  # checked above; narrows the type
        _check_layout(q_layout)
        _check_groups(n_groups, "create")
        if n_groups is not None and n_quantizers != 1:
            # TransformerEngine's warning, word for word.
            warnings.warn(
                "Using more than one GroupedQuantizer for a grouped input is not recommended",
                UserWarning,
                stacklevel=2,
            )
        if checkpoint_name is not None:
            raise ValueError(
                f"QuantizerFactory.create(checkpoint_name={checkpoint_name!r}): te_flax names the "
                "quantized operands of a whole GEMM, not of one quantizer; pass it to "
                "QuantizerFactory.create_set(checkpoint_name=...)"
            )
        quantizers: tuple[Quantizer | GroupedQuantizer | None, ...] = tuple(
            _quantizer(scaling_mode, q_dtype, kwargs, "QuantizerFactory.create")
            for _ in range(n_quantizers)
        )
        if n_groups is not None:
            quantizers = tuple(
                None if q is None else group_quantizer(q, n_groups, q_layout) for q in quantizers
            )
        return quantizers[0] if n_quantizers == 1 else quantizers

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[1] = 1,
        scaling_mode: ScalingMode | None = None,
        fwd_dtype: DTypeLike | None = None,
        bwd_dtype: DTypeLike | None = None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        *,
        sr_key: Array | None = None,
        quantize_meta_set: QuantizeMetaSet | None = None,
    ) -> QuantizerSet: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: Literal[2],
        scaling_mode: ScalingMode | None = None,
        fwd_dtype: DTypeLike | None = None,
        bwd_dtype: DTypeLike | None = None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        *,
        sr_key: Array | None = None,
        quantize_meta_set: QuantizeMetaSet | None = None,
    ) -> tuple[QuantizerSet, QuantizerSet]: ...

    @overload
    @staticmethod
    def create_set(
        n_quantizer_sets: int,
        scaling_mode: ScalingMode | None = None,
        fwd_dtype: DTypeLike | None = None,
        bwd_dtype: DTypeLike | None = None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        *,
        sr_key: Array | None = None,
        quantize_meta_set: QuantizeMetaSet | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]: ...

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1,
        scaling_mode: ScalingMode | None = None,
        fwd_dtype: DTypeLike | None = None,
        bwd_dtype: DTypeLike | None = None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        *,
        sr_key: Array | None = None,
        quantize_meta_set: QuantizeMetaSet | None = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """Fresh quantizer sets for ``n_quantizer_sets`` GEMMs (TransformerEngine's signature).

        Args:
          n_quantizer_sets: how many sets to create (default 1; ``layernorm_mlp`` takes 2).
          scaling_mode: build every quantizer with this ``ScalingMode`` and ``fwd_dtype`` /
            ``bwd_dtype`` instead of a recipe (not with ``fp8_recipe``).
          fwd_dtype: the dtype of ``x`` and ``kernel`` with ``scaling_mode`` (default
            ``float8_e4m3fn``; ``float4_e2m1fn`` for NVFP4).
          bwd_dtype: the gradient's dtype with ``scaling_mode`` (default ``float8_e5m2``;
            ``float4_e2m1fn`` for NVFP4).
          is_2x2x: accepted (None, True or False) and without effect: te_flax's ops quantize
            each tensor in the layouts their GEMMs contract.
          n_groups: None (default), or the number of groups of a grouped GEMM: then ``x``,
            ``kernel`` and ``dgrad`` are ``GroupedQuantizer``s with one quantizer per group, as
            TransformerEngine's, for ``te_flax.dense.grouped_dense`` (delayed-scaling state
            ``scale_inv [G, 1]``, ``amax_history [G, L]``; a ``quantize_meta_set`` state
            starts every group). The same as ``te_flax.dense.grouped_quantizer_set(
            create_set(...), n_groups)``.
          checkpoint_name: TransformerEngine's quantization checkpoint name (default None): the
            quantized operands each GEMM saves for its backward are named so with
            ``jax.ad_checkpoint.checkpoint_name``, so that a ``jax.checkpoint`` policy such as
            ``save_only_these_names(checkpoint_name)`` keeps them rather than quantizing again.
          fp8_recipe: the recipe; None means the recipe of the active ``te_flax.autocast``,
            or no quantization outside of one (unless ``scaling_mode`` is given).
          sr_key: the RNG key of stochastic rounding for ``NVFP4BlockScaling()`` (each set
            gets its own key split from it), unused by the other recipes. Without one (nor
            TransformerEngine's ``QuantizeMeta(stochastic_rounding_rng_state=...)`` in the
            gradient's metadata) NVFP4 rounds to nearest, as TE's quantizers do, and a
            warning says so once.
          quantize_meta_set: a ``QuantizeMetaSet`` of delayed-scaling state (``scale``,
            ``amax_history``) to start the ``x``, ``kernel`` and gradient quantizers from, as
            TransformerEngine's Flax modules pass it; optional here (fresh state otherwise).
            The gradient's ``stochastic_rounding_rng_state`` (TE's ``(4,)`` uint32 RNG state)
            is NVFP4's stochastic-rounding key.

        Returns:
          One ``QuantizerSet`` when ``n_quantizer_sets == 1``, else a tuple of them.
          ``is_2x2x`` False records TransformerEngine's layouts in grouped quantizers
          (``ROWWISE``, and ``COLWISE`` for a 1D block-scaled kernel), else ``ROWWISE_COLWISE``.

        Example usage::

          >>> import jax
          >>> from te_flax.quantize import DelayedScaling, MXFP8BlockScaling, QuantizerFactory
          >>> qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=16))
          >>> qs.x.scale_inv.shape, qs.x.amax_history.shape, qs.x.q_dtype.__name__
          ((1,), (16,), 'float8_e4m3fn')
          >>> qs.dgrad.q_dtype.__name__
          'float8_e5m2'
          >>> type(QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling()).x).__name__
          'BlockScaleQuantizer'
          >>> grouped = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), n_groups=4)
          >>> grouped.kernel.n_groups, grouped.kernel.quantizer.scale_inv.shape
          (4, (4, 1))
        """
        _check_count(n_quantizer_sets, "n_quantizer_sets")
        _check_groups(n_groups, "create_set")
        if is_2x2x is not None and not isinstance(is_2x2x, bool):
            raise TypeError(f"is_2x2x must be None or a bool, got {is_2x2x!r}")
        if checkpoint_name is not None and not isinstance(checkpoint_name, str):
            raise TypeError(
                f"checkpoint_name must be a str (a jax.checkpoint name) or None, got "
                f"{checkpoint_name!r}"
            )
        if quantize_meta_set is not None and not isinstance(quantize_meta_set, QuantizeMetaSet):
            raise TypeError(
                f"quantize_meta_set must be a te_flax.quantize.QuantizeMetaSet or None, got "
                f"{quantize_meta_set!r}"
            )
        if scaling_mode is not None:
            if fp8_recipe is not None:
                raise ValueError(
                    "QuantizerFactory.create_set takes a scaling_mode or an fp8_recipe, not both "
                    f"(got {scaling_mode} and {fp8_recipe!r}); the recipe is preferred"
                )
            _check_scaling_mode(scaling_mode)
            make = _mode_set_maker(scaling_mode, fwd_dtype, bwd_dtype, quantize_meta_set)
        else:
            recipe = get_autocast_recipe() if fp8_recipe is None else fp8_recipe
            for name, dtype in (("fwd_dtype", fwd_dtype), ("bwd_dtype", bwd_dtype)):
                if dtype is not None:
                    raise ValueError(
                        f"QuantizerFactory.create_set({name}=...) goes with scaling_mode=; a "
                        "recipe (given or from autocast) sets the dtypes through its "
                        "fp8_format: leave it None"
                    )
            make = _recipe_set_maker(recipe, quantize_meta_set)
            scaling_mode = ScalingMode.NO_SCALING if recipe is None else None
        sr_key = _key_from_meta(quantize_meta_set, sr_key)
        keys = _stochastic_rounding_keys(fp8_recipe, scaling_mode, sr_key, n_quantizer_sets)
        sets = tuple(make(key) for key in keys)
        if checkpoint_name is not None:
            sets = tuple(
                qs if qs.is_noop else dataclasses.replace(qs, checkpoint_name=checkpoint_name)
                for qs in sets
            )
        if n_groups is not None:
            layouts = _grouped_layouts(sets[0], is_2x2x)
            sets = tuple(grouped_quantizer_set(qs, n_groups, layouts) for qs in sets)
        return sets[0] if n_quantizer_sets == 1 else sets


def _check_count(value: object, name: str) -> None:
    check_positive_int(value, name, f"e.g. {name}=1")


def _check_scaling_mode(scaling_mode: object) -> None:
    if not isinstance(scaling_mode, ScalingMode):
        raise TypeError(
            f"scaling_mode must be a te_flax.quantize.ScalingMode, got {scaling_mode!r}; e.g. "
            "ScalingMode.CURRENT_TENSOR_SCALING, or pass fp8_recipe= to create_set instead"
        )


def _check_layout(q_layout: object) -> None:
    if q_layout is not None and not isinstance(q_layout, QuantizeLayout):
        raise TypeError(f"q_layout must be a te_flax.quantize.QuantizeLayout, got {q_layout!r}")


def _check_groups(n_groups: object, method: str) -> None:
    if n_groups is not None:
        check_positive_int(
            n_groups,
            f"QuantizerFactory.{method}(n_groups=...)",
            "the number of groups of a grouped GEMM (experts), or None for one GEMM",
        )


def _grouped_layouts(
    quantizer_set: QuantizerSet, is_2x2x: bool | None
) -> tuple[QuantizeLayout | None, ...]:
    """The layouts TransformerEngine's ``create_set`` gives x, kernel and dgrad: both with
    ``is_2x2x`` (its default for block scaling and on Hopper), else row-wise, and column-wise
    for a 1D block-scaled kernel."""
    if is_2x2x is None or is_2x2x:
        return (None, None, None)
    kernel = quantizer_set.kernel
    kernel_colwise = kernel is not None and kernel.scaling_mode.is_1d_block_scaling()
    rowwise = QuantizeLayout.ROWWISE
    return (rowwise, QuantizeLayout.COLWISE if kernel_colwise else rowwise, rowwise)


# TransformerEngine's channel for the stochastic-rounding key: a QuantizeMeta keyword.
_SR_STATE = "stochastic_rounding_rng_state"


def _key_from_meta(meta_set: QuantizeMetaSet | None, sr_key: Array | None) -> Array | None:
    """``sr_key``, or the key TransformerEngine's ``QuantizeMeta(stochastic_rounding_rng_state=
    ...)`` of the gradient carries: its ``(4,)`` uint32 state, read as the key data of JAX's
    ``rbg`` generator (the same four words), or a JAX key as it is."""
    state = None if meta_set is None else meta_set.grad.get_kwargs_dictionary().get(_SR_STATE)
    if state is None:
        return sr_key
    if sr_key is not None:
        raise ValueError(
            f"QuantizerFactory.create_set got both sr_key and QuantizeMeta({_SR_STATE}=...); "
            "pass one of them"
        )
    state = jnp.asarray(state)
    if jnp.issubdtype(state.dtype, jax.dtypes.prng_key):
        return state
    if state.shape != (4,) or state.dtype != jnp.uint32:
        raise ValueError(
            f"QuantizeMeta({_SR_STATE}=...) must be TransformerEngine's RNG state, uint32 of "
            f"shape (4,), or a JAX key, got {state.dtype}{list(state.shape)}"
        )
    return jax.random.wrap_key_data(state, impl="rbg")


# NVFP4 sets made without a key: said once per process, as TransformerEngine says nothing.
_WARNED_NO_KEY: list[bool] = []


def _stochastic_rounding_keys(
    recipe: Recipe | None, scaling_mode: ScalingMode | None, sr_key: Array | None, n: int
) -> list[Array | None]:
    recipe = get_autocast_recipe() if recipe is None and scaling_mode is None else recipe
    if isinstance(recipe, NVFP4BlockScaling) and recipe.stochastic_rounding:
        if sr_key is None:
            # TransformerEngine's result: without an RNG state its quantizers round to nearest.
            if not _WARNED_NO_KEY:
                _WARNED_NO_KEY.append(True)
                warnings.warn(
                    "NVFP4BlockScaling() rounds gradients stochastically, but this quantizer "
                    "set was made without an RNG key, so its gradients round to nearest (as "
                    "TransformerEngine's do without stochastic_rounding_rng_state). Pass "
                    "sr_key=jax.random.key(...) (a new one each step; modules draw it from the "
                    "'sr_rng' stream) for stochastic rounding, or say round-to-nearest with "
                    "NVFP4BlockScaling(disable_stochastic_rounding=True)",
                    UserWarning,
                    stacklevel=4,
                )
            return [None] * n
        return list(jax.random.split(sr_key, n))
    if sr_key is not None and scaling_mode is not None and scaling_mode.is_nvfp4_scaling:
        return list(jax.random.split(sr_key, n))
    return [None] * n


def _meta(meta_set: QuantizeMetaSet | None) -> tuple[dict[str, Any], ...]:
    if meta_set is None:
        return {}, {}, {}
    metas = (meta_set.x, meta_set.kernel, meta_set.grad)
    for meta in metas:
        if not isinstance(meta, QuantizeMeta):
            raise TypeError(f"a QuantizeMetaSet holds QuantizeMeta, got {meta!r}")
    # The stochastic-rounding state is the set's key (``_key_from_meta``), not a quantizer's.
    return tuple(
        {k: v for k, v in meta.get_kwargs_dictionary().items() if k != _SR_STATE} for meta in metas
    )


def _mode_set_maker(
    mode: ScalingMode,
    fwd_dtype: DTypeLike | None,
    bwd_dtype: DTypeLike | None,
    meta_set: QuantizeMetaSet | None,
) -> Any:
    x_args, kernel_args, grad_args = _meta(meta_set)
    if bwd_dtype is None and not mode.is_nvfp4_scaling:
        bwd_dtype = jnp.float8_e5m2

    def make(key: Array | None) -> QuantizerSet:
        if mode is ScalingMode.NO_SCALING:
            return noop_quantizer_set
        grad = dict(grad_args, sr_key=key) if key is not None else grad_args
        where = "QuantizerFactory.create_set"
        return QuantizerSet(
            _quantizer(mode, fwd_dtype, x_args, where),
            _quantizer(mode, fwd_dtype, kernel_args, where),
            _quantizer(mode, bwd_dtype, grad, where),
        )

    return make


def _recipe_set_maker(recipe: Recipe | None, meta_set: QuantizeMetaSet | None) -> Any:
    metas = _meta(meta_set)
    if recipe is not None:
        check_recipe(recipe)
    if meta_set is not None and not isinstance(recipe, DelayedScaling) and any(metas):
        raise ValueError(
            f"quantize_meta_set carries state ({', '.join(sorted(set().union(*metas)))}) "
            f"but {type(recipe).__name__ if recipe else 'no recipe'} keeps none; pass it "
            "with DelayedScaling only"
        )

    def make(key: Array | None) -> QuantizerSet:
        qs = _set_from_recipe(recipe, key)
        if meta_set is None or not isinstance(recipe, DelayedScaling):
            return qs
        x, kernel, grad = (
            _with_delayed_state(cast(DelayedScaleQuantizer, q), meta, "quantize_meta_set")
            for q, meta in zip((qs.x, qs.kernel, qs.dgrad), metas, strict=True)
        )
        return dataclasses.replace(qs, x=x, kernel=kernel, dgrad=grad)

    return make


def _with_delayed_state(
    quantizer: DelayedScaleQuantizer, kwargs: Mapping[str, Any], where: str
) -> DelayedScaleQuantizer:
    """The quantizer with TransformerEngine's ``scale`` (= 1 / scale_inv) and
    ``amax_history`` from ``kwargs``, where given."""
    unknown = sorted(set(kwargs) - set(_DELAYED_KWARGS))
    if unknown:
        raise TypeError(
            f"{where}: delayed scaling takes {', '.join(_DELAYED_KWARGS)}, got {unknown}"
        )
    changes: dict[str, Any] = {}
    if "scale" in kwargs:
        scale = jnp.asarray(kwargs["scale"], jnp.float32).reshape(1)
        changes["scale_inv"] = 1.0 / scale
    if "amax_history" in kwargs:
        changes["amax_history"] = jnp.asarray(kwargs["amax_history"], jnp.float32).reshape(-1)
    return dataclasses.replace(quantizer, **changes)


def _quantizer(
    mode: ScalingMode, q_dtype: DTypeLike | None, kwargs: Mapping[str, Any], where: str
) -> Quantizer | None:
    """One fresh quantizer of ``mode`` to ``q_dtype``, with ``kwargs``' state and options."""
    if mode is ScalingMode.NO_SCALING:
        return None
    if q_dtype is None:
        q_dtype = jnp.float4_e2m1fn if mode.is_nvfp4_scaling else jnp.float8_e4m3fn
    compatible = {jnp.dtype(d) for d in mode.get_compatible_q_dtypes()}
    if jnp.dtype(q_dtype) not in compatible:
        raise ValueError(
            f"{where}: {mode} quantizes to {' or '.join(sorted(map(str, compatible)))}, got "
            f"{jnp.dtype(q_dtype)}"
        )
    allowed: tuple[str, ...] = _DELAYED_KWARGS if mode is ScalingMode.DELAYED_TENSOR_SCALING else ()
    allowed = _NVFP4_KWARGS if mode.is_nvfp4_scaling else allowed
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"{where}: a {mode} quantizer takes {list(allowed) or 'no keyword arguments'}, got "
            f"{unknown}"
        )
    if mode is ScalingMode.DELAYED_TENSOR_SCALING:
        history = kwargs.get("amax_history")
        recipe = DelayedScaling(
            margin=kwargs.get("margin", 0),
            amax_history_len=1024 if history is None else int(jnp.size(history)),
            amax_compute_algo=kwargs.get("amax_compute_algo", "max"),
        )
        fresh = DelayedScaleQuantizer.fresh(q_dtype, recipe)
        return _with_delayed_state(fresh, kwargs, where)
    if mode is ScalingMode.CURRENT_TENSOR_SCALING:
        return CurrentScaleQuantizer(q_dtype)
    if mode is ScalingMode.MXFP8_1D_SCALING:
        return BlockScaleQuantizer(q_dtype)
    if mode.is_fp8_block_scaling:
        return Float8BlockQuantizer(q_dtype, 2 if mode is ScalingMode.FP8_2D_BLOCK_SCALING else 1)
    return NVFP4Quantizer(
        key=kwargs.get("sr_key"),
        use_rht=bool(kwargs.get("use_rht", False)),
        use_2d=mode is ScalingMode.NVFP4_2D_SCALING,
    )


def _set_from_recipe(recipe: Recipe | None, sr_key: Array | None) -> QuantizerSet:
    if recipe is None:
        return noop_quantizer_set
    check_recipe(recipe)
    if isinstance(recipe, NVFP4BlockScaling):
        # As TransformerEngine: the Hadamard transform for the inputs' and gradients' wgrad
        # layouts, 16x16 tiles for the kernel, stochastic rounding for the gradient only.
        rht = not recipe.disable_rht
        return QuantizerSet(
            NVFP4Quantizer(use_rht=rht),
            NVFP4Quantizer(use_2d=not recipe.disable_2d_quantization),
            NVFP4Quantizer(key=sr_key, use_rht=rht),
        )
    forward, backward = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    if isinstance(recipe, Float8BlockScaling):
        power_2 = not recipe.use_f32_scales
        return QuantizerSet(
            Float8BlockQuantizer(forward, recipe.x_block_scaling_dim, power_2),
            Float8BlockQuantizer(forward, recipe.w_block_scaling_dim, power_2),
            Float8BlockQuantizer(backward, recipe.grad_block_scaling_dim, power_2),
        )
    if isinstance(recipe, MXFP8BlockScaling):
        return QuantizerSet(
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(forward),
            BlockScaleQuantizer(backward),
        )
    if isinstance(recipe, Float8CurrentScaling):
        power_2 = recipe.use_power_2_scales
        return QuantizerSet(
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(forward, power_2),
            CurrentScaleQuantizer(backward, power_2),
            GemmPrecision(
                fprop=recipe.fp8_gemm_fprop.precision,
                dgrad=recipe.fp8_gemm_dgrad.precision,
                wgrad=recipe.fp8_gemm_wgrad.precision,
            ),
        )
    return QuantizerSet(
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(forward, recipe),
        DelayedScaleQuantizer.fresh(backward, recipe),
    )
