# Sourced by the scripts in this folder with what the environment is for; makes (or completes)
# a virtual environment, then activates it. Nothing else is needed on the machine besides a
# Python of the supported range (3.11 to 3.13): pip picks the JAX that Python is served (3.11:
# jax 0.10.2; 3.12 and newer: the newest of the range, 0.12).
#   train  the library and the `examples` extra, plus the CUDA build of jaxlib (the `cuda`
#          extra) where an NVIDIA GPU is present: what scripts/train needs, nothing more
#   test   (also the default) the test, GPU-compile, example and docs extras: the full set, with
#          the CUDA build of jaxlib that compiles for an H100 without one
#   oldest the test and example extras at the oldest tested versions (scripts/oldest.txt)
#   docs   the library and the `docs` extra: what scripts/docs needs
# The environment is VENV (default .venv), made with PYTHON (default: the newest Python 3.13 or
# 3.12 found, on PATH or installed by pyenv, else python3; the same for every script, so that
# scripts/train and scripts/test share one stack). A VENV of another Python version is made
# again (scripts/check_venv). Each use keeps its own install stamp ($VENV/.te_flax-train, ...),
# redone when pyproject.toml changes; pip installs only what is missing, so running one script
# after the other adds the difference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$(scripts/find_python 3.13 3.12 || command -v python3)}
VENV=${VENV:-.venv}
scripts/check_venv "$VENV" "$PYTHON"
constraints=()
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
    oldest)
        use=oldest
        extras=test,examples
        constraints=(--constraint scripts/oldest.txt)
        ;;
    *)
        use=test
        extras=test,gpu-compile,examples,docs
        ;;
esac
stamp=$VENV/.te_flax-$use
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/oldest.txt -nt "$stamp" ]; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    # --no-compile: pip would byte-compile every module of every package it installs (jax,
    # jaxlib's CUDA build, scipy, ...); Python compiles just the modules a run imports, on
    # first import. It makes a fresh venv about a fifth faster on two busy cores.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
        ${constraints[@]+"${constraints[@]}"} -e ".[$extras]"
    touch "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# Python's compiled bytecode, kept in the venv. Without it (PYTHONDONTWRITEBYTECODE set, or a
# tree that is not writable) every process compiles JAX's, Flax's and te_flax's sources again on
# import: `import te_flax` takes 3.7 s of CPU instead of 1.1 s, and the test run starts dozens
# of processes (its workers, the examples and scripts the tests launch). Under a prefix in the
# venv the source tree gets no __pycache__ folders, which is what PYTHONDONTWRITEBYTECODE is
# usually set for.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$VIRTUAL_ENV/pycache"
