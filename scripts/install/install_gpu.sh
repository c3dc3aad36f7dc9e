#!/usr/bin/env bash
# HOROVOD_ALQ_GPU=1 make install (= make install-gpu): a second virtual environment, .venv-gpu, with
# PyPI's CUDA build of torch (and the Triton it requires), numpy, scipy, mpi4py, this package in
# editable mode, and Horovod 0.28.1 built from its source distribution with NCCL
# (HOROVOD_GPU_OPERATIONS=NCCL), PyTorch, MPI and Gloo, without TensorFlow (the CPU venv's
# tensorflow-cpu cannot host Horovod's GPU ops, and TensorFlow's CUDA build pins another CUDA).
# It builds on a machine without a GPU (CUDA's compiler and headers are all it needs); what it
# builds runs only where there is one. .venv (the CPU venv of `make install`) is never touched.
#
# Called by scripts/install/install.sh when HOROVOD_ALQ_GPU=1. Idempotent, like the CPU install.
#
# Environment (besides install.sh's PYTHON, HOROVOD_ALQ_CACHE and HOROVOD_ALQ_JOBS):
#   HOROVOD_CUDA_HOME        the CUDA toolkit (bin/nvcc, include/cuda_runtime.h); default: the
#                            toolkit of the nvcc on PATH, else /usr/local/cuda
#   HOROVOD_ALQ_GPU_INDEX    the index that serves torch's CUDA build (default https://pypi.org/simple).
#                            pip's own configuration is not used for this venv (PIP_CONFIG_FILE=/dev/null,
#                            no find-links): a local folder holding the CPU wheel of the same version,
#                            as on the development machines, would otherwise win over the CUDA build
#   HOROVOD_ALQ_CUDA_CC      compute capabilities of Horovod's CUDA kernels (default 80,90: A100,
#                            H100/H200; newer GPUs run the sm_90 PTX)
#
# Patches of the Horovod source, each documented in its script:
#   patch_horovod.py         C++17 (as the CPU build; the TensorFlow edit is harmless without TF)
#   patch_horovod_gcc13.py   only where g++ >= 13 (as the CPU build)
set -euo pipefail

HOROVOD_VERSION=0.28.1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$ROOT/.venv-gpu"
VPY="$VENV/bin/python"
PIN="$ROOT/requirements/pinned.txt"
PYTHON=${PYTHON:-python3}
CACHE=${HOROVOD_ALQ_CACHE:-$HOME/.cache/horovod-alq}
JOBS=${HOROVOD_ALQ_JOBS:-$(nproc 2>/dev/null || echo 2)}
INDEX=${HOROVOD_ALQ_GPU_INDEX:-https://pypi.org/simple}
CC_LIST=${HOROVOD_ALQ_CUDA_CC:-80,90}

STEP="start"
HINT=""
BUILD_TMP=""

on_exit() {
    local rc=$?
    [[ -n "$BUILD_TMP" && -d "$BUILD_TMP" ]] && rm -rf "$BUILD_TMP"
    if [[ $rc -ne 0 ]]; then
        echo >&2
        echo "install (HOROVOD_ALQ_GPU=1) failed at step '$STEP': $HINT" >&2
    fi
    exit $rc
}
trap on_exit EXIT

step() {
    STEP=$1
    HINT=$2
    echo "==> $STEP"
}

sha() { sha256sum | cut -c1-16; }

source "$ROOT/scripts/install/horovod_wheel.sh"

# pip for this venv: the GPU index only, none of this machine's pip configuration (see above).
gpip() {
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" PIP_EXTRA_INDEX_URL="" PIP_INDEX_URL="$INDEX" \
        "$VPY" -m pip "$@"
}

# --------------------------------------------------------------------------------------------
# Everything that can be missing is looked for before anything is created or downloaded.
step "CUDA toolkit and build tools (HOROVOD_ALQ_GPU=1)" "install what is named above, or run make install without HOROVOD_ALQ_GPU for the CPU venv"
missing=()
if [[ -n "${HOROVOD_CUDA_HOME:-}" ]]; then
    CUDA_HOME=$HOROVOD_CUDA_HOME
    from="HOROVOD_CUDA_HOME"
elif command -v nvcc >/dev/null; then
    # nvcc may be a wrapper script (/usr/local/bin/nvcc here): ask it for its own folder.
    here=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
    CUDA_HOME=$(dirname "${here:-$(dirname "$(readlink -f "$(command -v nvcc)")")}")
    from="the nvcc on PATH"
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDA_HOME=/usr/local/cuda
    from="/usr/local/cuda"
else
    CUDA_HOME=""
    from=""
    missing+=("nvcc (CUDA's compiler: not on PATH, no /usr/local/cuda; install the CUDA toolkit 13 or set HOROVOD_CUDA_HOME)")
fi
if [[ -n "$CUDA_HOME" ]]; then
    [[ -x "$CUDA_HOME/bin/nvcc" ]] || missing+=("nvcc ($CUDA_HOME/bin/nvcc, from $from)")
    [[ -f "$CUDA_HOME/include/cuda_runtime.h" ]] || missing+=("the CUDA runtime headers ($CUDA_HOME/include/cuda_runtime.h, from $from)")
    ls "$CUDA_HOME"/lib64/libcudart* "$CUDA_HOME"/lib/libcudart* >/dev/null 2>&1 ||
        missing+=("the CUDA runtime library (libcudart in $CUDA_HOME/lib64, from $from)")
fi
for tool in g++ cmake mpicc mpirun; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
command -v "$PYTHON" >/dev/null || missing+=("$PYTHON (set PYTHON to a Python >= 3.10)")
if [[ ${#missing[@]} -gt 0 ]]; then
    HINT="missing: $(printf '%s; ' "${missing[@]}")nothing was installed and .venv is untouched"
    false
fi
cuda_version=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
echo "    nvcc: CUDA $cuda_version in $CUDA_HOME (from $from); g++ $(g++ -dumpfullversion); $(cmake --version | head -1)"

# --------------------------------------------------------------------------------------------
torch_pin=$(grep -E '^torch==' "$PIN")
torch_plain=${torch_pin%%+*}
stamp="$VENV/.horovod-alq-packages"
want=$(cat "$PIN" "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" <(echo "index=$INDEX") | sha)
if ! [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    step "CUDA packages on $INDEX" "$INDEX must serve $torch_plain built for CUDA (HOROVOD_ALQ_GPU_INDEX); nothing was installed and .venv is untouched"
    # Resolves torch's metadata only (no download of the wheel): the CUDA build requires nvidia-* packages.
    report=$(PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" PIP_EXTRA_INDEX_URL="" PIP_INDEX_URL="$INDEX" \
        "$PYTHON" -m pip install --dry-run --quiet --no-input --no-deps --ignore-installed --report - "$torch_plain" 2>&1) ||
        { HINT="cannot resolve $torch_plain on $INDEX (network?): ${report: -300}; $HINT"; false; }
    requires=$("$PYTHON" -c 'import json, sys; d = json.load(sys.stdin)["install"][0]["metadata"]; import re; print(d["version"], " ".join(re.split(r"[ ;=<>!~(\[]", r)[0] for r in d.get("requires_dist") or [] if r.startswith("nvidia-")))' <<<"$report")
    [[ "$requires" == *nvidia-* ]] || { HINT="$INDEX serves torch ${requires%% *} without the CUDA packages (nvidia-*); $HINT"; false; }
    echo "    torch ${requires%% *} requires ${requires#* }"
fi

# --------------------------------------------------------------------------------------------
step "virtual environment (.venv-gpu)" "delete .venv-gpu and run HOROVOD_ALQ_GPU=1 make install again"
"$PYTHON" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))'
if [[ ! -x "$VPY" ]]; then
    "$PYTHON" -m venv "$VENV"
    echo "    created $VENV"
else
    echo "    present: $VENV"
fi

# --------------------------------------------------------------------------------------------
step "python packages (CUDA torch)" "read pip's error above; $INDEX must serve torch's CUDA build (HOROVOD_ALQ_GPU_INDEX)"
# numpy, scipy, mpi4py and the rest at requirements/pinned.txt's versions; torch from the index
# with the CUDA packages and Triton it declares.
constraints="$VENV/.horovod-alq-constraints.txt"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "    up to date"
else
    rm -f "$stamp"
    grep -vE '^(torch|triton)==|^--' "$PIN" > "$constraints"
    start=$SECONDS
    echo "    pip install $torch_plain from $INDEX (the first time: about 4 GB of downloads)"
    gpip install -q --no-input "$(grep -E '^pip==' "$PIN")"
    gpip install -q --no-input -c "$constraints" --no-binary mpi4py "$torch_plain" numpy scipy mpi4py \
        psutil pyyaml cloudpickle cffi packaging setuptools wheel pytest hypothesis
    PYTHONWARNINGS=ignore gpip install -q --no-input --no-deps --no-build-isolation -e "$ROOT"
    echo "    pip took $((SECONDS - start)) s"
    HINT="a package is missing or broken in .venv-gpu"
    "$VPY" -c 'import numpy, scipy, torch, triton, mpi4py.MPI, horovod_alq'
    echo "$want" > "$stamp"
fi
if [[ "${HOROVOD_ALQ_STOP_AFTER:-}" == packages ]]; then
    echo "==> stopped after the python packages step (HOROVOD_ALQ_STOP_AFTER=packages) in ${SECONDS} s"
    exit 0
fi
read -r torch_version torch_cuda < <("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda)')
echo "    torch $torch_version, built for CUDA $torch_cuda"
HINT="torch $torch_version is not a CUDA build (torch.version.cuda is None): $INDEX served the CPU build"
[[ "$torch_cuda" != None ]]
HINT="torch $torch_version is built for CUDA $torch_cuda but nvcc is CUDA $cuda_version: the major versions must agree (HOROVOD_CUDA_HOME)"
[[ "${torch_cuda%%.*}" == "${cuda_version%%.*}" ]]

# --------------------------------------------------------------------------------------------
step "horovod $HOROVOD_VERSION with NCCL" "read the build log named above; delete $CACHE/wheels/<key> to force a rebuild"
read -r nccl_dir nccl_version versions < <("$VPY" - <<'EOF'
import os, sys
from importlib.metadata import distributions, version
import nvidia.nccl
nccl = [d for d in distributions() if (d.metadata["Name"] or "").startswith("nvidia-nccl")][0]
root = list(nvidia.nccl.__path__)[0]
print(root, nccl.metadata["Name"] + "==" + nccl.version, f"py{sys.version_info[0]}.{sys.version_info[1]}_torch{version('torch')}")
EOF
)
HINT="the NCCL wheel ($nccl_version) lacks include/nccl.h or lib/libnccl.so.2 in $nccl_dir"
[[ -f "$nccl_dir/include/nccl.h" && -f "$nccl_dir/lib/libnccl.so.2" ]]
echo "    NCCL: $nccl_version ($nccl_dir)"
build_env=(MAKEFLAGS="-j$JOBS" HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1
           HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_NCCL_LINK=SHARED
           HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST" HOROVOD_CUDA_HOME="$CUDA_HOME")
horovod_patches build_env
HINT="could not compute the cache key (mpirun --version, g++ -dumpfullversion)"
detail=$(cat "${patches[@]}" <(printf '%s\n' "${build_env[@]:1}" "$nccl_version" "$cuda_version") \
    <(mpirun --version 2>&1 | head -1) <(g++ -dumpfullversion) | sha)
key="horovod${HOROVOD_VERSION}_nccl_${versions}_${detail}"
# The NCCL wheel ships libnccl.so.2 only; Horovod's CMake looks for libnccl.so. torch's
# cpp_extension (Horovod's FindPytorch) finds cudart through CUDA_HOME, else through the nvcc on
# PATH, which may be a wrapper elsewhere (/usr/local/bin/nvcc here): both are set.
nccl_lib="$CACHE/nccl-lib/$key"
mkdir -p "$nccl_lib"
ln -sfn "$nccl_dir/lib/libnccl.so.2" "$nccl_lib/libnccl.so"
install_horovod_wheel gpip "$key" "${build_env[@]}" HOROVOD_NCCL_INCLUDE="$nccl_dir/include" \
    HOROVOD_NCCL_LIB="$nccl_lib" CUDA_HOME="$CUDA_HOME" PATH="$CUDA_HOME/bin:$PATH"

# --------------------------------------------------------------------------------------------
step "horovodrun --check-build" "Horovod was built without a required part; read the build log in $CACHE/logs"
check=$("$VPY" -m horovod.runner.launch --check-build 2>&1) || { echo "$check" >&2; false; }
grep -E '^Horovod v|:$|\[[ X]\]' <<<"$check" | sed 's/^/    /'
absent=()
for part in PyTorch MPI Gloo NCCL; do
    grep -q "\[X\] $part\s*$" <<<"$check" || absent+=("$part")
done
if [[ ${#absent[@]} -gt 0 ]]; then
    HINT="horovodrun --check-build lacks: ${absent[*]}"
    false
fi
echo "$check" > "$VENV/.horovod-alq-check-build"
echo "==> install (HOROVOD_ALQ_GPU=1) done in ${SECONDS} s: .venv-gpu"
