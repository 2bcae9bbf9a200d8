# Sourced by the scripts in this folder with what the environment is for; makes (or completes)
# the project's virtual environment in .venv, then activates it. Nothing else is needed on the
# machine besides Python 3.11+.
#   train  the library and the `examples` extra, plus the CUDA build of jaxlib (the `cuda`
#          extra) where an NVIDIA GPU is present: what scripts/train needs, nothing more
#   test   (also the default) the test, GPU-compile, example and docs extras: the full set, with
#          the CUDA build of jaxlib that compiles for an H100 without one
#   docs   the library and the `docs` extra: what scripts/docs needs
# Each keeps its own install stamp (.venv/.te_flax-train, .venv/.te_flax-test, ...), redone when
# pyproject.toml changes; pip installs only what is missing, so running one script after the
# other adds the difference and reinstalls nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
case "${1:-}" in
    train)
        use=train
        extras=examples
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            extras=examples,cuda
        fi
        ;;
    docs)
        use=docs
        extras=docs
        ;;
    *)
        use=test
        extras=test,gpu-compile,examples,docs
        ;;
esac
stamp=.venv/.te_flax-$use
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
