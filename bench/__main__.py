"""``python -m bench``: every CPU and deviceless-H100 benchmark in one process.

JAX runs on the CPU (``JAX_PLATFORMS=cpu``, unless set otherwise) and XLA's GPU compiler, used
deviceless, gets ``--xla_gpu_enable_triton_gemm=false``; both must be set before JAX starts.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

from bench.suite import main  # noqa: E402

main()
