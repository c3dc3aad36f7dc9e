"""The rows that run side by side in the same processes, in one declarative registry: the step
benchmark's (scripts/bench/train_step.py) and the time-to-accuracy study's. A row is Horovod's
``DistributedOptimizer`` with a compression, a DDP communication hook, or no exchange (``local``);
:func:`build` makes one around a model and its optimizer, and :attr:`Row.counted` says how its bytes
per step are counted (scripts/common/timing.py). Horovod tensor names are prefixed by the row's key,
so that Horovod's response cache never sees one name in two rows. PowerSGD's rows run with one DDP
bucket: scripts/bench/train_step.py's docstring says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PSGD_START = 2  # start_powerSGD_iter: the smallest PowerSGDState takes with error feedback and warm start


@dataclass(frozen=True)
class Row:
    """What one row runs: ``kind`` "local", "hvd" (Horovod, ``codec`` "fp32", "fp16", "alq" or
    "qsgd") or "ddp" (DDP's hook ``codec`` "fp32", "fp16", "bf16", "psgd" or "alq");
    ``options``: the compressor's or ``ALQState``'s keyword arguments (PowerSGD: ``rank``, an int
    or "matched", the rank whose bytes match 3-bit ALQ's); ``env``: process-wide variables, read at
    ``hvd.init()``, so the row runs in a launch of its own."""

    label: str
    kind: str = "local"
    codec: str = ""
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    @property
    def counted(self) -> str:
        """How its bytes are counted: "none", "arithmetic" (a ring allreduce of 4- or 2-byte
        values), "psgd" (PowerSGD's counters) or "measured" (the compressor's metrics())."""
        if self.kind == "local":
            return "none"
        return {"fp32": "arithmetic", "fp16": "arithmetic", "bf16": "arithmetic", "psgd": "psgd"}.get(
            self.codec, "measured"
        )

    @property
    def width(self) -> int:
        """Bytes per value of an uncompressed exchange."""
        return 4 if self.codec == "fp32" else 2


def hvd(label: str, codec: str, env: dict | None = None, **options) -> Row:
    return Row(label, "hvd", codec, options, env or {})


def ddp(label: str, codec: str, **options) -> Row:
    return Row(label, "ddp", codec, options)


_H, _H2P = "hierarchical", "hierarchical-two-phase"
STEP_ROWS: dict[str, Row] = {
    "local": Row("fwd+bwd+SGD alone (no exchange)"),
    "hvd-fp32": hvd("Horovod fp32 (Compression.none)", "fp32"),
    "hvd-fp16": hvd("Horovod fp16 (Compression.fp16)", "fp16"),
    "hvd-fp16-hier": hvd(
        "Horovod fp16, HOROVOD_HIERARCHICAL_ALLREDUCE=1 (own launch)",
        "fp16",
        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"},
    ),
    "hvd-alq": hvd("Horovod ALQCompressor(bits=3), auto", "alq", bits=3),
    "hvd-alq-f4": hvd("Horovod ALQ 3b, auto, fusion_bytes=4 MiB", "alq", bits=3, fusion_bytes=4 << 20),
    "hvd-alq-p": hvd("Horovod ALQ 3b, auto, pipelined in 1 MiB chunks", "alq", bits=3, pipeline_bytes=1 << 20),
    "hvd-alq-p512": hvd("Horovod ALQ 3b, auto, pipelined in 512 KiB chunks", "alq", bits=3, pipeline_bytes=512 << 10),
    "hvd-alq-np": hvd("Horovod ALQ 3b, auto, not pipelined (pipeline_bytes=0)", "alq", bits=3, pipeline_bytes=0),
    "hvd-alq-ag": hvd("Horovod ALQ 3b, allgather", "alq", bits=3, exchange="allgather"),
    "hvd-alq-2p": hvd("Horovod ALQ 3b, two-phase", "alq", bits=3, exchange="two-phase"),
    "hvd-alq-h": hvd("Horovod ALQ 3b, hierarchical", "alq", bits=3, exchange=_H),
    "hvd-alq-h4": hvd("Horovod ALQ 4b, hierarchical", "alq", bits=4, exchange=_H),
    "hvd-alq-h2p": hvd("Horovod ALQ 3b, hierarchical two-phase", "alq", bits=3, exchange=_H2P),
    "hvd-alq-e": hvd("Horovod ALQ 3b, auto, entropy wire", "alq", bits=3, wire="entropy"),
    "hvd-alq-e-p": hvd(
        "Horovod ALQ 3b, auto, entropy wire, pipelined in 1 MiB chunks",
        "alq",
        bits=3,
        wire="entropy",
        pipeline_bytes=1 << 20,
    ),
    "hvd-alq-e-p4": hvd(
        "Horovod ALQ 3b, auto, entropy wire, pipelined in 4 MiB chunks",
        "alq",
        bits=3,
        wire="entropy",
        pipeline_bytes=4 << 20,
    ),
    "hvd-alq-when": hvd("Horovod ALQ 3b, auto, compress='when-faster'", "alq", bits=3, compress="when-faster"),
    "hvd-alq4-e": hvd("Horovod ALQ 4b, auto, entropy wire", "alq", bits=4, wire="entropy"),
    "ddp-fp32": ddp("DDP allreduce (fp32)", "fp32"),
    "ddp-fp16": ddp("DDP fp16_compress_hook", "fp16"),
    "ddp-bf16": ddp("DDP bf16_compress_hook (wrapped, see --help)", "bf16"),
    "ddp-psgd2": ddp("DDP powerSGD_hook rank 2", "psgd", rank=2),
    "ddp-psgd8": ddp("DDP powerSGD_hook rank 8", "psgd", rank=8),
    "ddp-alq": ddp("DDP alq_hook, ALQState(bits=3), auto", "alq", bits=3),
    "ddp-alq-2p": ddp("DDP alq_hook 3b, two-phase", "alq", bits=3, exchange="two-phase"),
    "ddp-alq-h": ddp("DDP alq_hook 3b, hierarchical", "alq", bits=3, exchange=_H),
    "ddp-alq-h2p": ddp("DDP alq_hook 3b, hierarchical two-phase", "alq", bits=3, exchange=_H2P),
    "ddp-alq-e": ddp("DDP alq_hook 3b, auto, entropy wire", "alq", bits=3, wire="entropy"),
    "ddp-alq4-e": ddp("DDP alq_hook 4b, auto, entropy wire", "alq", bits=4, wire="entropy"),
    "ddp-alq-when": ddp("DDP alq_hook 3b, auto, compress='when-faster'", "alq", bits=3, compress="when-faster"),
}
ROWS: dict[str, Row] = {
    **STEP_ROWS,
    # the time-to-accuracy study's own
    "ddp-psgd": ddp("DDP PowerSGD, rank matched to 3 bits", "psgd", rank="matched"),
    "hvd-qsgdinf": hvd("QSGDinf 3 bits", "qsgd", bits=3),
    "hvd-alq-auto": hvd('ALQ bits="auto", budget 2.5', "alq", bits="auto", bit_budget=2.5),
    "hvd-alq-flat": hvd("ALQ 3 bits, flat two-phase", "alq", bits=3, exchange="two-phase"),
    "hvd-alq4-entropy": hvd('ALQ 4 bits, wire="entropy"', "alq", bits=4, wire="entropy"),
    "hvd-alq4-rate": hvd(
        'ALQ 4 bits, wire="entropy", code_entropy=2.8', "alq", bits=4, wire="entropy", code_entropy=2.8
    ),
    "hvd-alq4-rate21": hvd(
        'ALQ 4 bits, wire="entropy", code_entropy=2.1', "alq", bits=4, wire="entropy", code_entropy=2.1
    ),
    "hvd-alq-ef": hvd("ALQ 3 bits, error_feedback=True", "alq", bits=3, error_feedback=True),
    "hvd-alq2": hvd("ALQ 2 bits", "alq", bits=2),
    "hvd-alq2-ef": hvd("ALQ 2 bits, error_feedback=True", "alq", bits=2, error_feedback=True),
    # precondition="optimizer": the row's own (Adam-family) optimizer, given to the compressor
    "hvd-alq-pre": hvd("ALQ 3 bits, precondition=AdamW", "alq", bits=3, precondition="optimizer"),
    # ("optimizer", K): Preconditioner(optimizer, form=Form(refit=K)), the levels refit K rounds in
    "hvd-alq-pre30": hvd(
        "ALQ 3 bits, precondition=AdamW, refit 30 rounds in", "alq", bits=3, precondition=("optimizer", 30)
    ),
    "hvd-alq2-pre": hvd("ALQ 2 bits, precondition=AdamW", "alq", bits=2, precondition="optimizer"),
    "hvd-alq-auto-pre": hvd(
        'ALQ bits="auto", budget 2.5, precondition=AdamW', "alq", bits="auto", bit_budget=2.5, precondition="optimizer"
    ),
}


def _hooks():
    """DDP's 16-bit hooks by codec."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_hook(state, bucket):  # (no annotations: DDP checks them, and these would be strings)
        """bf16_compress_hook itself, under another name: DDP refuses to register the hook of that
        name without CUDA and NCCL 2.10+, though gloo allreduces bfloat16 on CPU."""
        return default_hooks.bf16_compress_hook(state, bucket)

    return {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook}


def _compression(row: Row, hvd, seed: int | None, opt=None):
    from horovod_alq.torch import ALQCompressor, QSGDCompressor

    if row.codec in ("fp32", "fp16"):
        return hvd.Compression.none if row.codec == "fp32" else hvd.Compression.fp16
    kind = ALQCompressor if row.codec == "alq" else QSGDCompressor
    options = {"compress": "always", **row.options}  # a row times one path unless it says otherwise
    pre = options.get("precondition")
    if pre == "optimizer":
        options["precondition"] = opt
    elif isinstance(pre, tuple):
        from horovod_alq.torch import Preconditioner
        from horovod_alq.torch.precondition import Form

        options["precondition"] = Preconditioner(opt, form=Form(refit=pre[1]))
    return kind(**options, **({} if seed is None else {"seed": seed}))


def build(
    key: str,
    model,
    opt,
    hvd=None,
    seed: int | None = None,
    matched_rank=None,
) -> dict:
    """Row ``key`` around ``model`` and its optimizer ``opt``: {"call": what to call (the model or
    its DDP wrapper), "model", "opt" (Horovod's wrapper for "hvd" rows), "state" (what counts its
    bytes: this package's compressor or ALQState, PowerSGDState, or None), "extra" (for the
    results)}. ``seed``: the compressors' and PowerSGD's (theirs by default); ``matched_rank(model)``:
    PowerSGD's rank "matched"."""
    row = ROWS[key]
    out = {"call": model, "model": model, "opt": opt, "state": None, "extra": {}}
    if row.kind == "hvd":
        comp = _compression(row, hvd, seed, opt)
        named = [(f"{key}.{k}", p) for k, p in model.named_parameters()]
        out["opt"] = hvd.DistributedOptimizer(opt, named_parameters=named, compression=comp)
        out["state"] = comp if hasattr(comp, "metrics") else None
    elif row.kind == "ddp":
        out.update(_ddp(row, model, seed, matched_rank))
    return out


def _ddp(row: Row, model, seed, matched_rank) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_alq.torch.ddp import ALQState, alq_hook

    one = 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1  # PowerSGD's rows: one bucket
    call = DDP(model, bucket_cap_mb=one if row.codec == "psgd" else None)  # (the optimizer holds the same parameters)
    out, hooks = {"call": call}, _hooks()
    if row.codec in ("fp16", "bf16"):
        call.register_comm_hook(None, hooks[row.codec])
    elif row.codec == "psgd":
        rank = row.options["rank"]
        rank = matched_rank(model) if rank == "matched" else rank
        seeded = {} if seed is None else {"random_seed": seed}
        state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=PSGD_START, **seeded)
        call.register_comm_hook(state, psgd.powerSGD_hook)
        out.update(state=state, extra={"powersgd_rank": rank} if row.options["rank"] == "matched" else {})
    elif row.codec == "alq":
        out["state"] = ALQState(**{"exchange": "auto", "wire": "fixed", "compress": "always", **row.options})
        call.register_comm_hook(out["state"], alq_hook)
    return out
