"""The example's configuration: a typed schema, YAML files, and ``key=value`` overrides.

OmegaConf checks every key and value against the schema, so a typo or a wrong type fails with
a message that names the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

__all__ = ["DEFAULT_CONFIG", "Config", "ConfigError", "load_config"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "lm_small.yaml"


@dataclasses.dataclass
class MoEConfig:
    """A mixture of experts in place of each block's MLP (``experts: 0``: the dense MLP).

    Each expert is an MLP of ``model.mlp_dim`` with ``model.activation``; ``top_k`` of them
    run per token. ``capacity_factor``: rows per expert ``ceil(tokens * top_k / experts *
    capacity_factor)``, the rest dropped; None is dropless. ``aux_loss_coeff``: the
    load-balancing loss's weight in the training loss.
    """

    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coeff: float = 0.01


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int = 256  # bytes
    d_model: int = 128
    heads: int = 4
    head_dim: int = 32
    layers: int = 2
    mlp_dim: int = 512
    activation: str = "gelu"  # "gelu" or "swiglu"
    frontend: str = "linen"  # "linen" or "nnx"
    # "handwritten": te_flax's FP8 layers composed by hand; "te": TE's TransformerLayer
    # (needs d_model = heads * head_dim, as TE derives the head size from them).
    block: str = "handwritten"
    # Context parallelism over mesh.context (the handwritten Linen blocks' attention):
    # "all_gather" or "ring" (TE's CPStrategy).
    context_parallel: str = "all_gather"
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    # Stack the blocks with nn.scan (one traced block, each layer's variables along a leading
    # axis); false unrolls them (one traced block per layer). The kernel path on a CPU
    # (TE_FLAX_PALLAS=1, kernels in Pallas interpret mode) needs false: the interpreter's host
    # callbacks are side effects, which nn.scan refuses in its body. Linen frontend.
    scan: bool = True


@dataclasses.dataclass
class TrainConfig:
    steps: int = 300
    batch: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 50  # at most; evaluations also come at least every tenth of the run
    eval_batches: int = 4
    seed: int = 0
    # "delayed", "current", "blockwise", "mxfp8", "nvfp4" or "none" (BF16)
    recipe: str = "delayed"
    amax_history_len: int = 16
    # FP8 attention (the recipe's fp8_dpa): q.k and p.v on float8 operands; delayed or current
    # scaling, the Linen front end (its attention is te_flax's DotProductAttention).
    fp8_attention: bool = False
    # Stop after this step, keeping the schedule of train.steps (to split a run in parts).
    stop_at: int | None = None
    # FP8 health: every this many steps one step runs inside te_flax.inspect_fp8() and keeps
    # the FP8 statistics of every GEMM operand for the report's figure (0: never; Linen only).
    fp8_stats_every: int = 20


@dataclasses.dataclass
class MeshConfig:
    """Sizes of the (data, fsdp, tensor) mesh axes, and of a context axis for context
    parallelism (with rules=cp); their product is the number of devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: str | None = None  # a text file; None: the built-in Python standard library text
    output_dir: str = "runs/lm"
    checkpoint_every: int = 100  # 0: no checkpoints
    # On resume, fit a checkpoint's FP8 state to this run's recipe (another amax_history_len,
    # a BF16 or current-scaling checkpoint, or the reverse) instead of refusing it.
    resume_migrate_fp8: bool = False
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # A logical-axis rule set of configs/rules (dp, fsdp, tp, tp_sp, dp_fsdp_tp, cp) or a path.
    rules: str = "dp"


_CHOICES = {
    "model.activation": ("gelu", "swiglu"),
    "model.frontend": ("linen", "nnx"),
    "model.block": ("handwritten", "te"),
    "model.context_parallel": ("all_gather", "ring"),
    "train.recipe": ("delayed", "current", "blockwise", "mxfp8", "nvfp4", "none"),
}


class ConfigError(ValueError):
    """A configuration the example cannot run: one line naming the key and what it takes."""


def _allowed_keys(config: Any, full_key: str) -> list[str]:
    """The keys of the section ``full_key`` (a dotted key) sits in."""
    section = full_key.rpartition(".")[0]
    node = OmegaConf.select(config, section) if section else config
    return sorted(node.keys()) if OmegaConf.is_config(node) else []


def _one_line(error: OmegaConfBaseException, schema: object) -> str:
    key = getattr(error, "full_key", "") or "?"
    first = str(error).splitlines()[0]
    if isinstance(error, ConfigKeyError):
        keys = ", ".join(_allowed_keys(schema, key))
        hint = first.partition("Did you mean: ")[2].rstrip("?")
        mean = f" (did you mean {hint}?)" if hint else ""
        return f"{key} is not a configuration key{mean}; the keys there are: {keys}"
    return f"{key}: {first}; see configs/lm_small.yaml for each key's type and default"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """The schema's defaults, then the YAML file, then ``key=value`` overrides, validated.

    Raises:
      ConfigError: a key the schema lacks, a value of the wrong type or outside its choices:
        one line that names the key and what it takes.
    """
    try:
        return _load(path, overrides)
    except OmegaConfBaseException as error:
        raise ConfigError(_one_line(error, OmegaConf.structured(Config))) from None


def _load(path: str | Path | None, overrides: list[str]) -> Config:
    config = OmegaConf.structured(Config)
    if path is not None:
        config = OmegaConf.merge(config, OmegaConf.load(path))
    if overrides:
        bad = [item for item in overrides if "=" not in item]
        if bad:
            raise ConfigError(f"overrides must be key=value, e.g. train.steps=100; got {bad}")
        config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(overrides)))
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(config, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {choices}; use one of those")
    positive = ("train.steps", "train.batch", "train.seq_len", "model.layers", "train.eval_every")
    positive += ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.context")
    for key in positive:
        if OmegaConf.select(config, key) < 1:
            raise ConfigError(
                f"{key} must be >= 1, got {OmegaConf.select(config, key)}; set {key} to a "
                "positive int"
            )
    if config.train.fp8_stats_every < 0:
        raise ConfigError(
            f"train.fp8_stats_every must be >= 0 (0: no FP8 statistics), got "
            f"{config.train.fp8_stats_every}"
        )
    m = config.model
    if m.block == "te" and m.d_model != m.heads * m.head_dim:
        raise ConfigError(
            f"model.block=te needs model.d_model = model.heads * model.head_dim (TE's "
            f"TransformerLayer uses head_dim = hidden_size / num_attention_heads); got "
            f"d_model={m.d_model}, heads={m.heads}, head_dim={m.head_dim}"
        )
    if m.moe.experts and (m.frontend, m.block) != ("linen", "handwritten"):
        raise ConfigError(
            f"model.moe.experts={m.moe.experts} needs model.frontend=linen and "
            f"model.block=handwritten (the MoE blocks are written in the Linen model); got "
            f"frontend={m.frontend}, block={m.block}"
        )
    if not m.scan and m.frontend != "linen":
        raise ConfigError(
            "model.scan=false (unrolled blocks) is the Linen model's; use model.frontend=linen "
            f"or model.scan=true; got frontend={m.frontend}"
        )
    t = config.train
    if t.fp8_attention and (t.recipe not in ("delayed", "current") or m.frontend != "linen"):
        raise ConfigError(
            "train.fp8_attention=true needs train.recipe=delayed or current and "
            f"model.frontend=linen; got recipe={t.recipe}, frontend={m.frontend}"
        )
    return OmegaConf.to_object(config)
