#!/usr/bin/env bash
# Install horovod-alq for development: Debian packages, a virtual environment at .venv with the
# pinned packages of requirements/pinned.txt, this package in editable mode, and Horovod built
# from its PyPI source distribution with TensorFlow, PyTorch, MPI and Gloo.
#
# Called by `make install`. Idempotent: a second run with nothing changed takes seconds.
#
# Environment:
#   PYTHON                      interpreter for the venv (default: python3; needs >= 3.10)
#   HOROVOD_ALQ_CACHE           cache folder, shared by all clones (default: ~/.cache/horovod-alq);
#                               Horovod wheels go to $HOROVOD_ALQ_CACHE/wheels/<key>/, build logs
#                               to $HOROVOD_ALQ_CACHE/logs/
#   HOROVOD_ALQ_SYSTEM_HOROVOD  1: reuse the Horovod (and torch, TensorFlow) that $PYTHON already
#                               imports: the venv sees $PYTHON's site-packages, the pins are not
#                               applied, and Horovod is neither built nor installed, only checked
#   HOROVOD_ALQ_JOBS            parallel compile jobs for the Horovod build (default: nproc)
#   HOROVOD_ALQ_TORCH_INDEX     a pip index that serves the pinned CPU build of torch (e.g. PyTorch's
#                               CPU wheel index), used only when pip, as configured, cannot find it
#   HOROVOD_ALQ_STOP_AFTER      packages: stop after the python packages step (for checking the
#                               package resolution without building Horovod)
#   HOROVOD_ALQ_GPU             1: build the CUDA venv .venv-gpu instead (torch's CUDA build, Horovod
#                               with NCCL; scripts/install/install_gpu.sh, `make install-gpu`)
set -euo pipefail

HOROVOD_VERSION=0.28.1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
PIN="$ROOT/requirements/pinned.txt"
PYTHON=${PYTHON:-python3}
CACHE=${HOROVOD_ALQ_CACHE:-$HOME/.cache/horovod-alq}
SYSTEM_HOROVOD=${HOROVOD_ALQ_SYSTEM_HOROVOD:-0}
JOBS=${HOROVOD_ALQ_JOBS:-$(nproc 2>/dev/null || echo 2)}
TORCH_INDEX=${HOROVOD_ALQ_TORCH_INDEX:-}
STOP_AFTER=${HOROVOD_ALQ_STOP_AFTER:-}

# HOROVOD_ALQ_GPU=1: the CUDA venv .venv-gpu instead (scripts/install/install_gpu.sh; .venv untouched)
if [[ "${HOROVOD_ALQ_GPU:-0}" == 1 ]]; then
    exec bash "$ROOT/scripts/install/install_gpu.sh"
fi

STEP="start"
HINT=""
BUILD_TMP=""

on_exit() {
    local rc=$?
    if [[ -n "$BUILD_TMP" && -d "$BUILD_TMP" ]]; then
        rm -rf "$BUILD_TMP"
    fi
    if [[ $rc -ne 0 ]]; then
        echo >&2
        echo "install failed at step '$STEP': $HINT" >&2
    fi
    exit $rc
}
trap on_exit EXIT

# step NAME HINT: print a header; HINT is what to do if this step fails.
step() {
    STEP=$1
    HINT=$2
    echo "==> $STEP"
}

sha() { sha256sum | cut -c1-16; }

source "$ROOT/scripts/install/horovod_wheel.sh"

# pip in the venv, without the warnings about local index folders that lack a package (this
# machine's pip configuration lists local indexes that hold only some packages).
vpip() {
    "$VPY" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2)
}

# --------------------------------------------------------------------------------------------
step "system packages" "install them by hand: apt-get update && apt-get install -y openmpi-bin libopenmpi-dev cmake g++ (and python3-venv python3-dev for Debian's Python) (as root)"
packages=(openmpi-bin libopenmpi-dev g++)
[[ "$SYSTEM_HOROVOD" == 1 ]] || packages+=(cmake)
# Debian's own Python lacks the venv module and the headers (mpi4py builds against them) until
# python3-venv and python3-dev are installed; a pyenv, conda or self-built Python has both.
python_path=$(readlink -f "$(command -v "$PYTHON" 2>/dev/null || echo /nonexistent)" 2>/dev/null || true)
if [[ "$python_path" == /usr/bin/* ]] && command -v dpkg-query >/dev/null && dpkg-query -S "$python_path" >/dev/null 2>&1; then
    packages+=(python3-venv python3-dev)
fi
missing=()
if command -v dpkg-query >/dev/null; then
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
else
    for c in mpirun mpicc g++ cmake; do
        command -v "$c" >/dev/null || missing+=("$c")
    done
fi
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "    present: ${packages[*]}"
elif ! command -v apt-get >/dev/null; then
    HINT="not a Debian system: install Open MPI (with mpicc), cmake and g++ yourself; missing: ${missing[*]}"
    false
elif [[ $(id -u) -ne 0 ]]; then
    HINT="run as root, or first: sudo apt-get update && sudo apt-get install -y ${missing[*]}"
    false
else
    echo "    installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${missing[@]}"
fi

# --------------------------------------------------------------------------------------------
step "python" "set PYTHON to a Python >= 3.10 that has the venv module (Debian: apt-get install python3-venv python3-dev)"
command -v "$PYTHON" >/dev/null || { HINT="no '$PYTHON' on PATH; $HINT"; false; }
"$PYTHON" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))'
echo "    $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# --------------------------------------------------------------------------------------------
step "virtual environment (.venv)" "delete .venv (make clean) and run make install again"
if [[ "$SYSTEM_HOROVOD" == 1 ]]; then site=true; else site=false; fi
if [[ ! -x "$VPY" ]]; then
    args=()
    [[ $site == true ]] && args+=(--system-site-packages)
    "$PYTHON" -m venv "${args[@]}" "$VENV"
    echo "    created $VENV (system site-packages: $site)"
else
    # Switch the existing venv's view of the system site-packages if the mode changed.
    if ! grep -q "^include-system-site-packages = $site\$" "$VENV/pyvenv.cfg"; then
        sed -i "s/^include-system-site-packages = .*/include-system-site-packages = $site/" "$VENV/pyvenv.cfg"
        echo "    switched system site-packages to $site"
    fi
    echo "    present: $VENV"
fi

# --------------------------------------------------------------------------------------------
step "python packages" "read pip's error above; versions live in requirements/pinned.txt"
pip_args=(--no-input --quiet)
stamp="$VENV/.horovod-alq-packages"
want=$(cat "$PIN" "$ROOT/setup.cfg" "$ROOT/pyproject.toml" <(echo "system=$SYSTEM_HOROVOD torch_index=$TORCH_INDEX") | sha)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "    up to date (requirements/pinned.txt, setup.cfg, pyproject.toml unchanged)"
    [[ -f "$VENV/.horovod-alq-torch" ]] && echo "    torch: $(cat "$VENV/.horovod-alq-torch")"
else
    rm -f "$stamp"
    if [[ "$SYSTEM_HOROVOD" == 1 ]]; then
        echo "    pip install (only what $PYTHON lacks, unpinned)"
        # Leave the user's frameworks alone: install only what is missing, unpinned.
        vpip install "${pip_args[@]}" pip setuptools wheel numpy scipy mpi4py pytest hypothesis tqdm matplotlib
    else
        vpip install "${pip_args[@]}" --no-deps "$(grep -E '^pip==' "$PIN")"
        # torch: the pinned CPU build (torch==X+cpu) is not on PyPI. Use it where pip, as the user
        # configured it, finds it (a local wheel folder, an index in pip.conf or PIP_EXTRA_INDEX_URL);
        # else from the index named by HOROVOD_ALQ_TORCH_INDEX; else PyPI's torch==X, the CUDA build,
        # with the CUDA packages and the Triton that it requires (it runs on CPU as well).
        torch_pin=$(grep -E '^torch==' "$PIN")
        torch_plain=${torch_pin%%+*}
        reachable() {  # resolves the wheel's metadata only, no download of the wheel itself
            vpip install "${pip_args[@]}" --dry-run --ignore-installed --no-deps "$@" >/dev/null 2>&1
        }
        torch_args=()
        if reachable "$torch_pin"; then
            torch_from="$torch_pin (the pinned CPU build, found by pip as configured)"
            pins=("$PIN")
        elif [[ -n "$TORCH_INDEX" ]]; then
            HINT="HOROVOD_ALQ_TORCH_INDEX=$TORCH_INDEX does not serve $torch_pin"
            reachable --extra-index-url "$TORCH_INDEX" "$torch_pin"
            torch_from="$torch_pin (the pinned CPU build, from HOROVOD_ALQ_TORCH_INDEX=$TORCH_INDEX)"
            torch_args=(--extra-index-url "$TORCH_INDEX")
            pins=("$PIN")
        else
            torch_from="$torch_plain from PyPI: the CUDA build with its nvidia-* and triton dependencies (about 4 GB; runs on CPU too). pip as configured does not find $torch_pin: for the CPU build (about 200 MB) set HOROVOD_ALQ_TORCH_INDEX to a CPU wheel index, or PIP_FIND_LINKS to a folder holding its wheel"
            # The pins without torch and triton; torch==X then resolves its own dependencies, held
            # to the pinned versions of everything else by a constraints file.
            pins=("$VENV/.horovod-alq-pins-cuda.txt")
            grep -vE '^(torch|triton)==' "$PIN" > "${pins[0]}"
            grep -vE '^(torch|triton)==|^--' "$PIN" > "$VENV/.horovod-alq-constraints.txt"
        fi
        echo "    torch: $torch_from"
        echo "    pip install (the first time: about 1 GB of downloads and a few minutes)"
        HINT="read pip's error above; versions live in requirements/pinned.txt"
        start=$SECONDS
        vpip install "${pip_args[@]}" "${torch_args[@]}" --no-deps -r "${pins[0]}"
        if [[ "${pins[0]}" != "$PIN" ]]; then
            vpip install "${pip_args[@]}" -c "$VENV/.horovod-alq-constraints.txt" "$torch_plain"
        fi
        echo "    pip took $((SECONDS - start)) s; torch $("$VPY" -c "from importlib.metadata import version; print(version('torch'))")"
        echo "$torch_from" > "$VENV/.horovod-alq-torch"
    fi
    # (PYTHONWARNINGS: setuptools warns about every editable install)
    PYTHONWARNINGS=ignore vpip install "${pip_args[@]}" --no-deps --no-build-isolation -e "$ROOT"
    HINT="a pinned package is missing or broken; if requirements/pinned.txt lacks a dependency, add it"
    if [[ "$SYSTEM_HOROVOD" == 1 ]]; then
        "$VPY" -c 'import numpy, scipy, mpi4py.MPI, pytest, hypothesis, tqdm, matplotlib, horovod_alq'
    else
        TF_CPP_MIN_LOG_LEVEL=3 "$VPY" -c 'import numpy, scipy, torch, triton, tensorflow, tf_keras, mpi4py.MPI, pytest, hypothesis, tqdm, matplotlib, sklearn, mlxtend, yaml, psutil, cloudpickle, cffi, horovod_alq'
    fi
    echo "$want" > "$stamp"
    echo "    installed"
fi
if [[ "$STOP_AFTER" == packages ]]; then
    echo "==> stopped after the python packages step (HOROVOD_ALQ_STOP_AFTER=packages) in ${SECONDS} s"
    exit 0
fi

# --------------------------------------------------------------------------------------------
if [[ "$SYSTEM_HOROVOD" == 1 ]]; then
    step "horovod (reusing the existing installation)" "HOROVOD_ALQ_SYSTEM_HOROVOD=1 needs a Horovod that '$PYTHON' imports; PYTHON must be a system or conda Python, not another venv (its packages are invisible to a new venv)"
    hvd_id=$("$VPY" -c 'import horovod; print("horovod", horovod.__version__, "from", horovod.__file__)')
    echo "    $hvd_id"
else
    step "horovod $HOROVOD_VERSION" "read the build log named above; delete $CACHE/wheels to force a rebuild"
    versions=$("$VPY" - <<'EOF'
import sys
from importlib.metadata import version
print(f"py{sys.version_info[0]}.{sys.version_info[1]}_torch{version('torch')}_tf{version('tensorflow-cpu')}")
EOF
)
    # The wheel depends on the frameworks' versions, the patch, the build settings and the MPI.
    build_env=(MAKEFLAGS="-j$JOBS" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
               HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1)
    horovod_patches build_env
    detail=$(cat "${patches[@]}" <(printf '%s\n' "${build_env[@]:1}") <(mpirun --version 2>&1 | head -1) <(g++ -dumpfullversion) | sha)
    key="horovod${HOROVOD_VERSION}_${versions}_${detail}"
    install_horovod_wheel vpip "$key" "${build_env[@]}"
    hvd_id=$key
fi

# --------------------------------------------------------------------------------------------
step "horovodrun --check-build" "Horovod was built without a required part; delete $CACHE/wheels and rerun, and read the build log in $CACHE/logs"
# The full check imports TensorFlow several times (about 30 s), so it runs once per Horovod
# installation; later runs only check that Horovod's framework libraries are still there.
cstamp="$VENV/.horovod-alq-checked"
libs_present() {
    [[ "$SYSTEM_HOROVOD" == 1 ]] && return 0
    "$VPY" - <<'EOF'
import glob, importlib.util, os, sys
root = os.path.dirname(importlib.util.find_spec("horovod").origin)
sys.exit(not all(glob.glob(os.path.join(root, sub, "mpi_lib*.so")) for sub in ("torch", "tensorflow")))
EOF
}
if [[ -f "$cstamp" && "$(cat "$cstamp")" == "$hvd_id" ]] && libs_present; then
    echo "    passed when this Horovod was installed; to see it again: .venv/bin/horovodrun --check-build"
else
    rm -f "$cstamp"
    # (= .venv/bin/horovodrun --check-build, also where horovodrun lies outside the venv)
    check=$(TF_CPP_MIN_LOG_LEVEL=3 "$VPY" -m horovod.runner.launch --check-build 2>&1) || { echo "$check" >&2; false; }
    grep -E '^Horovod v|:$|\[[ X]\]' <<<"$check" | sed 's/^/    /'
    required=(TensorFlow PyTorch MPI Gloo)
    if [[ "$SYSTEM_HOROVOD" == 1 ]]; then required=(); fi
    absent=()
    for part in "${required[@]}"; do
        grep -q "\[X\] $part\s*$" <<<"$check" || absent+=("$part")
    done
    if [[ ${#absent[@]} -gt 0 ]]; then
        HINT="horovodrun --check-build lacks: ${absent[*]}. $HINT"
        false
    fi
    echo "$hvd_id" > "$cstamp"
fi
# --------------------------------------------------------------------------------------------
step "fused CPU codec" "the compressors still work without it (plain torch kernels); for the fast path install g++ and check the warning above"
# Compiled once per source version into the cache (about a minute); later runs load it. Tests and
# jobs would otherwise each build it on first use. A failure is reported here and fails `make test`
# (scripts/install/check_codec.py), unless HOROVOD_ALQ_ALLOW_TORCH_CODEC=1.
TORCH_EXTENSIONS_QUIET=1 "$VPY" -W ignore "$ROOT/scripts/install/check_codec.py" --warn

# --------------------------------------------------------------------------------------------
step "pip check" "a package lacks a dependency it declares: add that dependency to requirements/pinned.txt"
# tf_keras declares `tensorflow`, which is left out on purpose: tensorflow-cpu provides the same
# module (requirements/pinned.txt). Every other broken requirement fails the install.
if [[ "$SYSTEM_HOROVOD" == 1 ]]; then
    echo "    skipped (HOROVOD_ALQ_SYSTEM_HOROVOD=1: the packages are the user's)"
else
    pip_check=$("$VPY" -m pip check 2>&1) || true
    broken=$(grep -vE '^No broken requirements found|^tf-keras [^ ]+ requires tensorflow, which is not installed\.$' <<<"$pip_check" || true)
    if [[ -n "$broken" ]]; then
        echo "$broken" >&2
        false
    fi
    echo "    no broken requirements (tf_keras's declared tensorflow is provided by tensorflow-cpu)"
fi

echo "==> install done in ${SECONDS} s"
