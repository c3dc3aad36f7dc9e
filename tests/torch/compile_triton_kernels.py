"""Compile the Triton codec's kernels for sm_90 (H100/H200) down to cubins, without a GPU.

Run by tests/torch/test_codecs.py in a fresh process with TRITON_INTERPRET=0 (Triton picks
interpreter or compiler when it is first imported). Prints one line per kernel variant.
"""

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from horovod_alq.torch.codecs import triton as triton_codec  # noqa: E402


def ptr(t):
    return "*" + t


ENCODE = dict(
    x_ptr=ptr("fp32"),
    norms_ptr=ptr("fp32"),
    codes_ptr=ptr("u8"),
    u_ptr=ptr("fp32"),
    lv_ptr=ptr("fp32"),
    wd_ptr=ptr("fp32"),
    n="i64",
    d="i64",
    code_bytes="i64",
    seed="i64",
)
VARIANTS = [
    (
        "_encode_fused_kernel",
        ENCODE,
        dict(LINF=False, BITS=3, LINEAR=True, HAS_U=False, BLOCK=1024, ITERS=8, Q=64, QITERS=5),
    ),
    (
        "_codes_kernel",
        dict(
            x_ptr=ptr("bf16"),
            inv_ptr=ptr("fp32"),
            s_ptr=ptr("fp32"),
            codes_ptr=ptr("u8"),
            u_ptr=ptr("fp32"),
            lv_ptr=ptr("fp32"),
            wd_ptr=ptr("fp32"),
            n="i64",
            d="i64",
            code_bytes="i64",
            seed="i64",
        ),
        dict(BITS=6, LINEAR=False, HAS_U=False, Q=64),
    ),
    (
        "_norm_partials_kernel",
        dict(
            x_ptr=ptr("fp64"), total_ptr=ptr("fp64"), bad_ptr=ptr("i32"), n="i64", d="i64", nb="i64", S="i64", CH="i64"
        ),
        dict(LINF=True, RB=8, BLOCK=128, ITERS=1),
    ),
    (
        "_decode_sum_kernel",
        dict(
            out_ptr=ptr("fp32"),
            pay_ptr=ptr("u8"),
            off_ptr=ptr("i64"),
            table_ptr=ptr("fp32"),
            n="i64",
            d="i64",
            nb="i64",
            scale="fp32",
        ),
        dict(NUM_PAYLOADS=4, BITS=3, G=256, ALIGNED=True),
    ),
    (
        "_stats_kernel",
        dict(
            x_ptr=ptr("fp16"),
            norms_ptr=ptr("fp32"),
            grid_ptr=ptr("fp64"),
            sr_ptr=ptr("fp64"),
            sr2_ptr=ptr("fp64"),
            hist_ptr=ptr("fp64"),
            n="i64",
            d="i64",
            nb="i64",
            S="i64",
            CH="i64",
        ),
        dict(X64=False, HIST=True, GBITS=10, R=4, BLOCK=1024, ITERS=8),
    ),
]


def main() -> int:
    module = triton_codec.kernels(False)
    target = GPUTarget("cuda", 90, 32)
    for name, signature, constants in VARIANTS:
        start = time.time()
        source = triton.compiler.ASTSource(
            getattr(module, name), {**signature, **{k: "constexpr" for k in constants}}, constants
        )
        compiled = triton.compile(source, target=target)
        size = len(compiled.asm["cubin"])
        assert size > 1000, name
        print(f"{name} {constants}: cubin {size} bytes, {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
