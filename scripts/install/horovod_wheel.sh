# Horovod's wheel, built once per cache key from PyPI's source distribution and installed into a
# venv. Sourced by install.sh (CPU) and install_gpu.sh (NCCL); both set ROOT, VPY, VENV, CACHE,
# HOROVOD_VERSION, HINT and BUILD_TMP (removed by their exit trap).

# horovod_patches ENV_ARRAY_NAME: sets `patches` (the scripts that edit the source) and adds what
# the compiler needs to the named build-environment array. GCC 13 and later (Debian 13's GCC 14):
# libstdc++ no longer includes some standard headers through others, which Horovod 0.28.1 relies on
# (pre-include them), and one FlatBuffers template no longer compiles (patch_horovod_gcc13.py).
# Only there do both enter the cache key, so older compilers keep theirs.
horovod_patches() {
    local -n env_ref=$1
    patches=("$ROOT/scripts/install/patch_horovod.py")
    if (( $(g++ -dumpversion | cut -d. -f1) >= 13 )); then
        patches+=("$ROOT/scripts/install/patch_horovod_gcc13.py")
        env_ref+=(CXXFLAGS="${CXXFLAGS:-} -include cstdint -include stdexcept -include string")
    fi
}

# install_horovod_wheel PIP KEY ENV...: installs the wheel cached under $CACHE/wheels/KEY (building
# it first, with ENV, if absent) with the pip function PIP, unless the venv's stamp says KEY is
# installed. `patches` comes from horovod_patches.
install_horovod_wheel() {
    local pip=$1 key=$2
    shift 2
    local wheel_dir="$CACHE/wheels/$key" hstamp="$VENV/.horovod-alq-horovod" installed log start
    installed=$("$VPY" -c "from importlib.metadata import version; print(version('horovod'))" 2>/dev/null || true)
    if [[ "$installed" == "$HOROVOD_VERSION" && -f "$hstamp" && "$(cat "$hstamp")" == "$key" ]]; then
        echo "    up to date (cache key $key)"
        return
    fi
    mkdir -p "$CACHE/wheels" "$CACHE/logs"
    # One build at a time per cache, also across clones.
    exec 9>"$CACHE/.lock"
    flock 9
    if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        echo "    using cached wheel $(ls "$wheel_dir"/horovod-*.whl)"
    else
        log="$CACHE/logs/build-$key.log"
        echo "    no cached wheel for $key"
        echo "    building from the PyPI source distribution (about 10 minutes on 2 cores); log: $log"
        BUILD_TMP=$(mktemp -d "$CACHE/build.XXXXXX")
        HINT="could not download the horovod==$HOROVOD_VERSION sdist; check the network"
        "$pip" download -q --no-input --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$BUILD_TMP"
        tar -xzf "$BUILD_TMP/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD_TMP"
        HINT="scripts/install/patch_horovod*.py no longer match the Horovod source; see docs in those scripts"
        local patch
        for patch in "${patches[@]}"; do
            "$VPY" "$patch" "$BUILD_TMP/horovod-$HOROVOD_VERSION"
        done
        HINT="the Horovod build failed: see the end of $log (printed above)"
        start=$SECONDS
        if ! (cd "$BUILD_TMP/horovod-$HOROVOD_VERSION" &&
              env "$@" "$VPY" -m pip wheel -v --no-input --no-build-isolation --no-deps \
                  -w "$BUILD_TMP/wheel" .) >"$log" 2>&1; then
            tail -n 40 "$log" >&2
            false
        fi
        echo "    built in $((SECONDS - start)) s"
        mkdir -p "$wheel_dir"
        mv "$BUILD_TMP"/wheel/horovod-*.whl "$wheel_dir/"
    fi
    HINT="pip could not install the cached wheel; delete $wheel_dir to rebuild it"
    "$pip" install -q --no-input --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    flock -u 9
    echo "$key" > "$hstamp"
    echo "    installed horovod $HOROVOD_VERSION"
}
