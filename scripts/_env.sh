# Sourced by the scripts in this folder: makes (or refreshes) the project's virtual environment
# in .venv with the test, GPU-compile and example extras, then activates it. Nothing else is needed on the
# machine besides Python 3.11+.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.te_flax-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet -e '.[test,gpu-compile,examples]'
    touch "$stamp"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
