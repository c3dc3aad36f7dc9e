#!/usr/bin/env bash
# The GPU check in one call on a lent GPU machine (docs/guides/gpu.md), which has no network: its
# own python3 with CUDA torch, Triton, numpy, scipy, nvcc, cmake and the nvidia-nccl wheel, but no
# Horovod. A Horovod wheel built here would not load there (another Python and torch), so Horovod
# 0.28.1 is built there from its source distribution, carried in build/device/ (make gpu-device-prep),
# with this repository's patches (scripts/install/patch_horovod*.py), twice and in the background
# while the sections that need no Horovod run:
#   /tmp/hvd-nccl  HOROVOD_GPU_OPERATIONS=NCCL: the Horovod compressor over NCCL at world size 1
#   /tmp/hvd-gloo  no GPU operations (CUDA tensors staged through host memory to gloo): the
#                  compressor on 2 ranks on the one GPU (NCCL refuses two ranks on one device)
# Both without MPI where the machine has no mpicc, and without TensorFlow.
#
#   here:    make gpu-device-prep
#   device:  bash scripts/bench/gpu_device.sh      (carry: build/device; timeout 600 s)
#   anywhere with nvcc and CUDA torch:  PY=.venv-gpu/bin/python bash scripts/bench/gpu_device.sh --build-only
#
# Writes to $OUT (default build/device-out): gpu_paths.md/.json (every section but Horovod's),
# gpu_paths_horovod.md/.json (the two Horovod sections), device.log, build-nccl.log, build-gloo.log.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/build/device-out}
PY=${PY:-python3}
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # (the builds cd elsewhere)
SDIST="$ROOT/build/device/horovod-0.28.1.tar.gz"
JOBS=${HOROVOD_ALQ_JOBS:-7}  # compile jobs of each of the two Horovod builds
VARIANTS=${GPU_DEVICE_VARIANTS-nccl gloo}  # which Horovod builds ("": none)
BUDGET=${GPU_DEVICE_BUDGET:-570}  # seconds for the whole call: builds still running 90 s before it are stopped
export PATH="$PATH:/usr/local/cuda/bin"
mkdir -p "$OUT"
cd "$ROOT"
exec > >(tee "$OUT/device.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
command -v nvcc && nvcc --version | tail -2
"$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)'
nproc
BUILD_ONLY=0
[[ "${1:-}" == --build-only ]] && BUILD_ONLY=1  # only the Horovod builds and their --check-build (no GPU needed)
if [[ $BUILD_ONLY == 0 ]] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "no CUDA device for $PY: nothing built or run (the dry run: python -m scripts.bench.gpu_paths --device cpu --tiny)"
    exit 2
fi

# build NAME GPU_OPS: Horovod into /tmp/hvd-NAME (a --target folder), log in $OUT/build-NAME.log
build() {
    local name=$1 ops=$2 src=/tmp/hvd-src-$1 log="$OUT/build-$1.log"
    (
        set -e
        rm -rf "$src" && mkdir -p "$src" && tar -xzf "$SDIST" -C "$src"
        src="$src/horovod-0.28.1"
        "$PY" scripts/install/patch_horovod.py "$src"
        # nvcc may be a wrapper script: ask it for its folder
        local here
        here=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
        local env=(MAKEFLAGS=-j$JOBS HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
                   HOROVOD_WITH_GLOO=1 HOROVOD_BUILD_CUDA_CC_LIST=90 HOROVOD_CUDA_HOME="$(dirname "$here")")
        command -v mpicc >/dev/null && env+=(HOROVOD_WITH_MPI=1) || env+=(HOROVOD_WITHOUT_MPI=1)
        if (( $(g++ -dumpversion | cut -d. -f1) >= 13 )); then
            "$PY" scripts/install/patch_horovod_gcc13.py "$src"
            env+=(CXXFLAGS="-include cstdint -include stdexcept -include string")
        fi
        if [[ "$ops" == NCCL ]]; then
            local nccl
            nccl=$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')
            mkdir -p "/tmp/nccl-lib-$name" && ln -sf "$nccl/lib/libnccl.so.2" "/tmp/nccl-lib-$name/libnccl.so"
            env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_INCLUDE="$nccl/include"
                  HOROVOD_NCCL_LIB="/tmp/nccl-lib-$name")
        fi
        local t0=$SECONDS
        # torch's cpp_extension finds cudart through CUDA_HOME, else through the nvcc on PATH
        (cd "$src" && env "${env[@]}" CUDA_HOME="$(dirname "$here")" PATH="$(dirname "$here")/bin:$PATH" "$PY" -m pip wheel -v --no-index --no-build-isolation --no-deps -w "/tmp/whl-$name" .)
        "$PY" -m pip install -q --no-index --no-deps --target "/tmp/hvd-$name" /tmp/whl-"$name"/horovod-*.whl
        echo "built $name in $((SECONDS - t0)) s"
    ) >"$log" 2>&1
}

pids=()
if [[ -f "$SDIST" ]]; then
    echo "== building Horovod (NCCL; no GPU operations) in the background"
    for variant in $VARIANTS; do
        build "$variant" "$([[ $variant == nccl ]] && echo NCCL || echo none)" &
        pids+=($!)
        renice -n 5 -p $! >/dev/null || true
    done
else
    echo "== no $SDIST (make gpu-device-prep): the Horovod sections will be skipped"
fi

if [[ $BUILD_ONLY == 1 ]]; then
    ok=0
    for pid in "${pids[@]}"; do wait "$pid" || ok=1; done
    for variant in $VARIANTS; do
        tail -n 2 "$OUT/build-$variant.log"
        PYTHONPATH="/tmp/hvd-$variant:$PYTHONPATH" "$PY" -m horovod.runner.launch --check-build || ok=1
    done
    echo "== builds done in $((SECONDS - start)) s"
    exit $ok
fi

echo "== the check without Horovod"
"$PY" -m scripts.bench.gpu_paths --out "$OUT/gpu_paths.md" \
    --only codec,bench,ddp-gpt,ddp-resnet,fsdp,diloco,compile,ranks-exchanges,ranks-train
rc=$?
echo "   exit $rc after $((SECONDS - start)) s"

echo "== Horovod"
built=1
for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - start < BUDGET - 90 )); do sleep 2; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "   a Horovod build still runs at $((SECONDS - start)) s: stopped (GPU_DEVICE_BUDGET=$BUDGET)"
        pkill -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null
        built=0
    fi
    wait "$pid" || built=0
done
[[ ${#pids[@]} -gt 0 ]] || built=0
tail -n 3 "$OUT"/build-*.log 2>/dev/null
hargs=()
[[ -d /tmp/hvd-gloo ]] && hargs+=(--horovod-gloo /tmp/hvd-gloo)
if [[ -d /tmp/hvd-nccl ]]; then
    export PYTHONPATH="/tmp/hvd-nccl:$PYTHONPATH"
    "$PY" -m horovod.runner.launch --check-build
fi
"$PY" -m scripts.bench.gpu_paths --out "$OUT/gpu_paths_horovod.md" --only horovod,ranks-horovod "${hargs[@]}"
hrc=$?
echo "== done in $((SECONDS - start)) s: check exit $rc, Horovod sections exit $hrc, builds ok $built"
exit $(( rc || hrc ))
