"""The shared settings object: validation, merging, the front-ends' use of it, the docs table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import RANK_ENV

from horovod_alq.exchange.registry import choices
from horovod_alq.settings import DEFAULTS, FRONT_ENDS, NAMES, NOT_SERVED, Settings, configure, partly, served_table

ROOT = Path(__file__).resolve().parents[1]


def _adamw():
    """An AdamW, the changed value of ``precondition``."""
    import torch

    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])


# For each setting, keywords that give it a valid value other than its default.
CHANGED = {
    "method": {"method": "amq"},
    "bits": {"bits": 4},
    "bucket_size": {"bucket_size": 512},
    "norm": {"norm": "l2"},
    "bit_budget": {"bits": "auto", "bit_budget": 2.5},
    "bits_per": {"bits": "auto", "bits_per": "bucket", "bucket_size": 512},
    "bits_max": {"bits": "auto", "bits_max": 4},
    "exchange": {"exchange": "two-phase"},
    "bits_second": {"method": "qsgdinf", "bits_second": 4},
    "adapt_second": {"adapt_second": True},
    "update_steps": {"update_steps": (0, 5)},
    "update_every": {"update_every": 7},
    "min_size": {"min_size": 10},
    "seed": {"seed": 5},
    "wire": {"wire": "entropy"},
    "code_entropy": {"bits": 4, "wire": "entropy", "code_entropy": 2.5},
    "error_feedback": {"error_feedback": True},
    "error_feedback_dtype": {"error_feedback_dtype": "bfloat16"},
    "precondition": {"precondition": _adamw()},
    "codec": {"codec": "torch"},
    "fusion_bytes": {"fusion_bytes": 1 << 20},
    "pipeline_bytes": {"pipeline_bytes": 1 << 20},
    "overlap": {"overlap": False},
    "compress": {"compress": "when-faster"},
    "timeout": {"timeout": 9},
    "clip": {"method": "terngrad", "clip": True},
}


def test_every_setting_has_a_changed_value_and_a_docstring():
    assert set(CHANGED) == set(NAMES)
    source = (ROOT / "horovod_alq" / "settings.py").read_text()
    for name in NAMES:  # a field line followed by its docstring
        assert re.search(rf'^    {name}: .*\n    """', source, flags=re.M), f"{name} has no docstring"


@pytest.mark.parametrize(
    "keywords, match",
    [
        ({"method": "sgd"}, "unknown method"),
        ({"bits": 9}, "bits must be"),
        ({"bits": "four"}, "bits must be"),
        ({"method": "qsgdinf", "bits": "auto"}, "adaptive method"),
        ({"bits": "auto", "bits_second": 4}, "bits_second"),
        ({"bit_budget": 2.5}, "bit_budget applies to bits='auto' only"),
        ({"bits": "auto", "bits_per": "layer"}, "bits_per must be one of"),
        ({"bits": 3, "bits_max": 4}, "bits_max applies to bits='auto' only"),
        ({"bits": "auto", "bits_max": 2}, "bits_max must be an integer from 3 to 8"),
        ({"bits": "auto", "bits_max": 4, "bit_budget": 4.5}, "bit_budget must be a number from 2 to 4"),
        ({"bits": "auto", "bits_max": 4, "bits_per": "bucket"}, "bits_max applies to bits_per='tensor'"),
        ({"bucket_size": 0}, "bucket_size must be"),
        ({"norm": "l1"}, "norm must be"),
        ({"method": "qsgd", "norm": "linf"}, "fixed norm"),
        ({"exchange": "ring"}, "exchange"),
        ({"adapt_second": "yes"}, "adapt_second"),
        ({"update_every": -1}, "update_every"),
        ({"min_size": -1}, "min_size"),
        ({"seed": 1.5}, "seed"),
        ({"wire": "huffman"}, "wire must be one of 'fixed', 'entropy'"),
        ({"codec": 3}, "codec"),
        ({"fusion_bytes": -1}, "fusion_bytes"),
        ({"pipeline_bytes": -1}, "pipeline_bytes must be a non-negative integer"),
        ({"timeout": -1}, "timeout"),
        ({"compress": "sometimes"}, "compress must be one of 'auto', 'when-faster', 'always'"),
        ({"clip": True}, "clip applies to terngrad only"),
        ({"method": "terngrad", "bits": 4}, "terngrad"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(keywords, match):
    with pytest.raises(ValueError, match=match):
        Settings(**keywords)


def test_terngrad_takes_two_bits_and_methods_are_canonical():
    assert Settings(method="terngrad").bits == 2
    assert Settings(method="ALQ").method == "alq"
    assert Settings(update_steps=[0, 3]).update_steps == (0, 3)  # hashable, comparable


def test_of_merges_keywords_over_settings():
    base = Settings(bits=4, timeout=60)
    merged = Settings.of(base, bits=None, exchange="two-phase")  # None: not given
    assert (merged.bits, merged.timeout, merged.exchange) == (4, 60, "two-phase")
    assert base.exchange == "auto"  # immutable
    assert Settings(**merged.keywords()) == merged
    with pytest.raises(TypeError, match="unknown setting 'bitz'"):
        Settings.of(None, bitz=3)
    with pytest.raises(TypeError, match="must be a horovod_alq.settings.Settings"):
        Settings.of({"bits": 3})


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_front_end_refuses_the_values_it_does_not_serve(front_end):
    for name, (allowed, why) in partly().get(front_end, {}).items():
        for value in {"exchange": choices()}.get(name, ()):
            if value in allowed:
                Settings.of(None, front_end, **{name: value})
            else:
                with pytest.raises(ValueError, match=re.escape(f"{front_end} does not serve {name}={value!r}")):
                    Settings.of(None, front_end, **{name: value})


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_front_end_refuses_what_it_does_not_serve(front_end):
    for name, why in NOT_SERVED[front_end].items():
        with pytest.raises(ValueError, match=re.escape(f"{front_end} does not serve {name}=")) as err:
            Settings.of(None, front_end, **CHANGED[name])
        assert why in str(err.value)
        Settings.of(None, front_end, **{name: DEFAULTS[name]})  # the default is always accepted


def test_configure_builds_the_state_the_settings_describe():
    setup = configure(
        Settings(
            bits=4, bucket_size=512, exchange="two-phase", seed=7, overlap=False, fusion_bytes=1 << 20, bits_second=5
        )
    )
    assert (setup.quantizer.bits, setup.quantizer.bucket_size, setup.second.bits, setup.seed) == (4, 512, 5, 7)
    engine = setup.engine(uid="t")
    assert (engine.exchange, engine.fusion_bytes, engine.early) == ("two-phase", 1 << 20, False)
    auto = configure(Settings(bits="auto", bit_budget=2.5, bucket_size=64)).state.auto
    assert auto is not None and auto.budget == 2.5
    capped = configure(Settings(bits="auto", bit_budget=2.5, bucket_size=64, bits_max=4)).state.auto
    assert auto.widths == (2, 3, 4, 5, 6, 7, 8) and capped.widths == (2, 3, 4)


def test_docs_table_is_the_codes():
    text = (ROOT / "docs" / "guides" / "settings.md").read_text()
    found = re.search(
        r"<!-- generated: horovod_alq.settings.served_table\(\) -->\n(.*?)<!-- end generated -->", text, flags=re.S
    )
    assert found, "docs/guides/settings.md lost its generated table markers"
    assert found.group(1) == served_table(), (
        "docs/guides/settings.md's table differs from the code: regenerate it with "
        "python -c 'from horovod_alq.settings import served_table; print(served_table(), end=\"\")'"
    )


# ------------------------------------------------------------------ every front-end takes them
def _allowed(front_end: str, name: str, value) -> tuple:
    """The values of ``name`` that ``front_end`` serves (``(value,)`` when it serves every value)."""
    return partly().get(front_end, {}).get(name, ((value,), ""))[0]


def _torch_front_ends():
    from horovod_alq.torch import QuantizedCompressor
    from horovod_alq.torch.ddp import ALQState
    from horovod_alq.torch.fsdp import ALQReduceScatter

    return {
        "Horovod PyTorch": lambda **kw: QuantizedCompressor(**kw),
        "DDP hook": lambda **kw: ALQState(**kw),
        "FSDP2": lambda **kw: ALQReduceScatter(**kw),
    }


@pytest.mark.parametrize("front_end", ["Horovod PyTorch", "DDP hook", "FSDP2"])
def test_torch_front_ends_take_every_setting(front_end):
    make = _torch_front_ends()[front_end]
    for name, keywords in CHANGED.items():
        keywords = {"method": "alq", **keywords}
        if name in NOT_SERVED[front_end] or keywords[name] not in _allowed(front_end, name, keywords[name]):
            with pytest.raises(ValueError, match=f"does not serve {name}="):
                make(**keywords)
            continue
        made = make(**keywords)
        assert getattr(made.settings, name) == Settings(**keywords).keywords()[name], name
        # the same object through settings= gives the same settings
        assert make(settings=Settings(**keywords)).settings == made.settings


def test_positional_method_bits_bucket_size_agree_across_torch_front_ends():
    from horovod_alq.torch import QuantizedCompressor
    from horovod_alq.torch.ddp import ALQState
    from horovod_alq.torch.fsdp import ALQReduceScatter

    made = [QuantizedCompressor("amq", 4, 512), ALQState(None, "amq", 4, 512), ALQReduceScatter(None, "amq", 4, 512)]
    assert {(m.settings.method, m.settings.bits, m.settings.bucket_size) for m in made} == {("amq", 4, 512)}
    assert {m.settings for m in made[:2]} == {Settings("amq", 4, 512)}


def test_a_subclass_method_overrides_the_settings():
    from horovod_alq.torch import AMQCompressor, TernGradCompressor

    assert AMQCompressor(settings=Settings(method="alq", bits=4)).settings.method == "amq"
    assert TernGradCompressor(settings=Settings(bits=4)).settings.bits == 2


_TF_MPI = """
import json, sys
from horovod_alq.settings import NOT_SERVED, Settings
CHANGED = json.loads(sys.argv[1])
from mpi4py import MPI
from horovod_alq.mpi import QuantizedAllreduce
from horovod_alq.tensorflow import QuantizedCompressor
makers = {"mpi4py": lambda **kw: QuantizedAllreduce(MPI.COMM_SELF, **kw),
          "Horovod TensorFlow": lambda **kw: QuantizedCompressor(**kw)}
out = {}
for fe, make in makers.items():
    for name, kw in CHANGED.items():
        kw = {"method": "alq", **kw}
        if "update_steps" in kw: kw["update_steps"] = tuple(kw["update_steps"])
        try:
            made = make(**kw)
            out[f"{fe}/{name}"] = ["ok", getattr(made.settings, name) == Settings(**kw).keywords()[name]]
        except ValueError as err:
            out[f"{fe}/{name}"] = ["refused", str(err)]
print("RESULT" + json.dumps(out))
"""


#: Settings whose changed value is no JSON (an optimizer): both front-ends refuse them in Settings.of,
#: tested in this process by test_a_front_end_refuses_what_it_does_not_serve.
_IN_PROCESS = ("precondition",)


def test_tensorflow_and_mpi4py_take_every_setting():
    env = {**os.environ, **RANK_ENV}
    run = subprocess.run(
        [sys.executable, "-c", _TF_MPI, json.dumps({k: v for k, v in CHANGED.items() if k not in _IN_PROCESS})],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    assert run.returncode == 0 and line, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(line[0][len("RESULT") :])
    for fe in ("mpi4py", "Horovod TensorFlow"):
        for name in (n for n in NAMES if n not in _IN_PROCESS):
            kind, detail = out[f"{fe}/{name}"]
            if name in NOT_SERVED[fe] or CHANGED[name][name] not in _allowed(fe, name, CHANGED[name][name]):
                assert kind == "refused" and f"does not serve {name}=" in detail, (fe, name, detail)
            else:
                assert kind == "ok" and detail is True, (fe, name, detail)
