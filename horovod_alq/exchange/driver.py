"""The driver of a round's buffers (:func:`run`): every buffer's exchange, stage by stage, so that
every rank issues the same collectives in the same order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .job import Decoded, Deferred, Job, Piece, Steps, Tensor


@dataclass
class Started:
    """A buffer whose exchange began before its round was run (:meth:`.engine.Engine.add`): the
    buffer's own job (its stream is the round's ``[offset, offset + length)``), its steps, and the
    wait of the collective they asked for first."""

    job: Job
    steps: Steps
    wait: Callable[[], Tensor] | None
    offset: int


def run(job: Job, steps: Callable[[Job, int], Steps], started: dict[int, Started] | None = None) -> Decoded:
    """Every buffer of ``job`` through ``steps``, stage by stage: all buffers' first collectives are
    issued, then each buffer waits for its first and issues its second, and so on, so every rank
    issues the same collectives in the same order and none waits before it has issued all of a stage.
    Exchanges raise only after their last collective, so an error leaves no collective unissued.
    A pipelined buffer (:mod:`.pipeline`) starts its chunks' collectives itself (:class:`.job.Deferred`)
    and waits for them in its own order, the same on every rank, each one after every rank started it.
    ``started``: buffers whose first collective is already under way (their pieces are shifted
    into the round's stream; their bytes are counted in ``job``)."""
    started = dict(started or {})
    for i in range(len(job.layout.buffers)):
        if i not in started:
            started[i] = Started(job, steps(job, i), None, 0)
    buffers = [started[i] for i in range(len(job.layout.buffers))]
    pieces: list[Piece] = []
    active = list(range(len(buffers)))
    while active:
        still = []
        for k in active:
            b = buffers[k]
            try:
                request = b.steps.send(None if b.wait is None else b.wait())
                while isinstance(request, Deferred):  # a pipelined buffer's chunk: started, not waited for
                    request = b.steps.send(b.job.issue(request.request))
            except StopIteration as stop:
                pieces += [dataclasses.replace(p, lo=p.lo + b.offset, hi=p.hi + b.offset) for p in stop.value]
                continue
            b.wait = b.job.issue(request)
            still.append(k)
        active = still
    for b in {id(b.job): b for b in buffers if b.job is not job}.values():
        job.sent += b.job.sent
        job.received += b.job.received
        job.encoded += b.job.encoded
        if b.job.second_statistics is not None:
            job.add_second_statistics(b.job.second_statistics)
        if b.job.first_statistics is not None:
            job.add_first_statistics(b.job.first_statistics)
    return Decoded(job.ops, job.layout.length, pieces)
