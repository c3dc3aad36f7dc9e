#!/usr/bin/env python
"""scripts/demo/train_gpt.py with error feedback from a later step, a switch only the studies use,
set through the compressor's private state (not a setting): ``+ef<step>`` turns error feedback on
from that step (``alq@3+ef30``; earlier steps without it). Plain specs and ``+ef``
(``error_feedback=True``) pass through to the demo unchanged.

    mpirun -np 4 python -m scripts.study.feedback_switches --methods alq@3,alq@3+ef30
"""

from __future__ import annotations

import sys

from scripts.demo import train_gpt as tg


def split(spec: str) -> tuple[str, int | None]:
    """``"alq@3+ef"`` -> ``("alq@3", 0)``; ``"alq@3+ef30"`` -> ``("alq@3", 30)``; no suffix:
    ``(spec, None)``."""
    base, _, tail = spec.partition("+ef")
    if base == spec:
        return spec, None
    try:
        return base, int(tail or 0)
    except ValueError:
        raise SystemExit(f"{spec!r}: +ef or +ef<first step> (alq@3+ef30)") from None


def switched(spec: str) -> bool:
    """Whether ``spec`` needs this module (a switch the demo does not have)."""
    return bool(split(spec)[1])


def feedback_from(opt, comp, step: int) -> None:
    """Error feedback on ``comp`` from step ``step`` on: installed at that step's ``zero_grad``,
    before its backward pass hands the gradients to the exchange."""
    from horovod_alq.exchange.feedback import ErrorFeedback

    calls = [0]
    zero_grad = opt.zero_grad

    def counted(*a, **kw):
        if calls[0] == step:
            comp._state.feedback = ErrorFeedback()
        calls[0] += 1
        return zero_grad(*a, **kw)

    opt.zero_grad = counted


def main(argv=None) -> int:
    demo_train, demo_make_run = tg.train, tg.make_run

    def train(spec, args, data, hvd):
        base, start = split(spec)
        if not switched(spec):
            return demo_train(spec, args, data, hvd)
        if tg.parse_method(base)[0] not in tg.QUANTIZED:
            raise SystemExit(f"{spec!r}: +ef<step> is for the Horovod rows")

        def make_run(*a, **kw):
            model, plain, opt, state, extra = demo_make_run(*a, **kw)
            feedback_from(opt, state, start)
            return model, plain, opt, state, extra

        tg.make_run = make_run
        try:
            out = demo_train(base, args, data, hvd)
        finally:
            tg.make_run = demo_make_run
        return {**out, "spec": spec}

    tg.train = train
    tg.split_feedback = lambda spec: (split(spec)[0], split(spec)[1] is not None)
    return tg.main(argv)


if __name__ == "__main__":
    sys.exit(main())
