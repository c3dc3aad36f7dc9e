"""Check that the default CPU codec loads: codec ``cpu``, the compiled one
(horovod_alq/torch/codecs/cpu.py, built and loaded by horovod_alq/torch/codecs/cpu_build.py), which
``codec="auto"`` picks for CPU tensors.

Where it cannot be built or loaded the compressors still work, on the plain torch kernels (codec
``torch``), but slower, and the tests of the compiled codec skip. So a failed build must not pass
unnoticed: this check exits 1 naming the codec and the reason, unless the environment variable
``HOROVOD_ALQ_ALLOW_TORCH_CODEC=1`` asks for the fallback (then it warns and exits 0).

    python scripts/install/check_codec.py           # make test runs this before pytest
    python scripts/install/check_codec.py --warn    # the install: report, never fail
"""

from __future__ import annotations

import os
import sys
import warnings

ALLOW = "HOROVOD_ALQ_ALLOW_TORCH_CODEC"


def main(argv: list[str]) -> int:
    warn_only = "--warn" in argv
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu_build warns too; the message below says it all
        from horovod_alq.torch.codecs import cpu_build

        status = cpu_build.status()
    if status.startswith("fused CPU codec loaded"):
        print(f"    codec 'cpu' (the compiled CPU codec) loaded: {cpu_build.cached_library()}")
        return 0
    message = (
        f"codec 'cpu' (the compiled CPU codec, horovod_alq/torch/codecs/cpu_build.py) did not load: "
        f"{status}. The compressors would fall back to the plain torch kernels (codec 'torch') and "
        f"the compiled codec's tests would skip. Fix the build (a C++ compiler, g++, and torch's "
        f"headers are needed, and HOROVOD_ALQ_FUSED must not be 0), or set {ALLOW}=1 to accept the fallback."
    )
    if os.environ.get(ALLOW) == "1":
        print(f"WARNING: {message} ({ALLOW}=1 is set: going on with codec 'torch')", file=sys.stderr)
        return 0
    if warn_only:
        print(f"WARNING: {message} (`make test` fails on this)", file=sys.stderr)
        return 0
    print(f"ERROR: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
