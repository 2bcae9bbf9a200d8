"""The targets ``te_flax.explain`` compiles for: this machine, or an H100 without one.

An H100 program is compiled by XLA's real GPU compiler (the CUDA build of jaxlib, the
``gpu-compile`` extra) on a machine without a GPU: a *deviceless* compile for the target
described below, written from the card's published specifications (NVIDIA H100 SXM5 80GB,
compute capability 9.0a: 132 SMs at 1.98 GHz, 50 MiB L2, 80 GB HBM3 at 3.35 TB/s, 228 KiB
shared memory per SM, 18 NVLink 4 links, PCIe 5.0 x16). The arguments' shardings move onto as
many deviceless GPUs, in meshes of the same shape and axis names.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["GPU_TARGETS", "HOST_TARGETS", "deviceless_gpus", "local_gpu", "on_devices"]

# XLA's GpuTargetConfigProto, in the text format jaxlib 0.10 to 0.12 reads.
_H100_SXM = """\
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
dnn_version_info { major: 9 minor: 10 patch: 0 }
gpu_device_info {
  name: "NVIDIA H100 80GB HBM3"
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }
  core_count: 132
  fpus_per_core: 128
  clock_rate_ghz: 1.98
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  device_memory_size: 84942979072
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  device_interconnect_info { active_links: 18 }
}
"""
GPU_TARGETS = {"h100": _H100_SXM}
HOST_TARGETS = ("cpu", "host")
_DEVICE_KINDS = {"h100": "H100"}


def local_gpu(target: str) -> bool:
    """Whether this process sees a GPU of ``target``'s kind (then nothing is deviceless)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend: a CPU host
        return False
    return any(_DEVICE_KINDS[target] in device.device_kind for device in devices)


def _cuda_plugin() -> str | None:
    """The installed CUDA plugin of jaxlib (``jax_plugins.xla_cuda12``), if any."""
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is None or namespace.submodule_search_locations is None:
        return None
    plugins = pkgutil.iter_modules(namespace.submodule_search_locations, "jax_plugins.")
    return next((p.name for p in plugins if p.name.startswith("jax_plugins.xla_cuda")), None)


def deviceless_gpus(target: str, count: int) -> list[Any]:
    """``count`` GPUs of ``target`` for a deviceless compile (no GPU needed)."""
    teaching = (
        f"explain(target={target!r}) compiles the program for an {target.upper()} with XLA's "
        "GPU compiler, without a GPU here (a deviceless compile)"
    )
    plugin = _cuda_plugin()
    if plugin is None:
        raise RuntimeError(
            f"{teaching}, which needs the CUDA build of jaxlib: pip install "
            "'te-flax[gpu-compile]' (jax[cuda12]); none is installed here. target='cpu' "
            "explains the program compiled for this machine's CPU, where FP8 GEMMs are emulated."
        )
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=GPU_TARGETS[target], topology=f"1x1x{count}"
        )
    except NotImplementedError as error:  # the plugin did not start
        raise RuntimeError(
            f"{teaching}; the CUDA plugin of jaxlib ({plugin}) is installed but did not start "
            f"({error}): on a machine without a GPU it starts only with JAX_PLATFORMS=cpu set "
            "before JAX starts. Run again with JAX_PLATFORMS=cpu (here it is "
            f"{os.environ.get('JAX_PLATFORMS', 'not set')!r})."
        ) from error
    return list(topology.devices)


def _first_mesh(leaves: list[Any]) -> Mesh | None:
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh  # type: ignore[return-value]
    return None


def on_devices(tree: Any, devices: list[Any]) -> Any:
    """``tree`` with each array (or ``jax.ShapeDtypeStruct``) made a ``ShapeDtypeStruct`` on
    ``devices``: a ``NamedSharding``'s spec on a mesh of the same shape and axis names, any
    other array replicated; other leaves (Python scalars, None) as they are."""
    leaves = jax.tree.leaves(tree)
    source = _first_mesh(leaves)
    shape = source.devices.shape if source is not None else (len(devices),)
    names = source.axis_names if source is not None else ("devices",)
    if np.prod(shape) > len(devices):
        raise ValueError(
            f"the arguments are sharded over {int(np.prod(shape))} devices but only "
            f"{len(devices)} are available to compile for"
        )
    mesh_devices = np.array(devices[: int(np.prod(shape))], dtype=object).reshape(shape)
    mesh = Mesh(mesh_devices, names, axis_types=getattr(source, "axis_types", None))

    def moved(leaf: Any) -> Any:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        if isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple != mesh.shape_tuple:
            raise ValueError(
                "explain moves the arguments onto the target's devices with their mesh: they "
                f"must share one mesh, got {sharding.mesh.shape_tuple} and {mesh.shape_tuple}"
            )
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=NamedSharding(mesh, spec),
            weak_type=bool(getattr(leaf, "weak_type", False)),
        )

    return jax.tree.map(moved, tree)
