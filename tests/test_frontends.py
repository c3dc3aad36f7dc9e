"""The five public compressor classes and ``compressor_for(name)``: same keywords, same methods, same
errors in PyTorch and TensorFlow (both are built from horovod_alq.frontends)."""

import importlib
import pickle

import numpy as np
import pytest

from horovod_alq.core import Quantizer
from horovod_alq.core.methods import METHODS

FRAMEWORKS = ["horovod_alq.torch", "horovod_alq.tensorflow"]

# (class name, keywords) -> the method and bits it must configure
CLASS_CASES = [
    ("ALQCompressor", {}, "alq", 3),
    ("ALQCompressor", {"normless": True, "bits": 4}, "alq-n", 4),
    ("AMQCompressor", {"bits": 2}, "amq", 2),
    ("AMQCompressor", {"normless": True}, "amq-n", 3),
    ("QSGDCompressor", {}, "qsgdinf", 3),
    ("QSGDCompressor", {"norm": "l2", "bits": 5}, "qsgd", 5),
    ("NUQSGDCompressor", {"bits": 4}, "nuqsgd", 4),
    ("TernGradCompressor", {}, "terngrad", 2),
    ("TernGradCompressor", {"bits": 2}, "terngrad", 2),
]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def package(request):
    if request.param.endswith("tensorflow"):
        pytest.importorskip("tensorflow")
    return importlib.import_module(request.param)


def _method_name(comp) -> str:
    return comp._method.name


@pytest.mark.parametrize("cls_name, kwargs, method, bits", CLASS_CASES)
def test_class_keywords_select_method(package, cls_name, kwargs, method, bits):
    comp = getattr(package, cls_name)(bucket_size=512, **kwargs)
    assert (_method_name(comp), comp.bits, comp.bucket_size) == (method, bits, 512)
    assert isinstance(comp, package.QuantizedCompressor)
    # starting levels are the core's for that configuration
    np.testing.assert_array_equal(comp.levels, Quantizer(method, bits=bits, bucket_size=512).levels)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compressor_by_name(package, method):
    comp = package.compressor_for(method, bits=4, bucket_size=1024, min_size=10)
    assert _method_name(comp) == method
    assert comp.bits == (2 if method == "terngrad" else 4)  # TernGrad ignores bits, as documented
    assert (comp.bucket_size, comp.min_size) == (1024, 10)


def test_class_docstrings_and_default_instance(package):
    assert "coordinate descent" in package.ALQCompressor.__doc__
    for name in ("ALQCompressor", "AMQCompressor", "QSGDCompressor", "NUQSGDCompressor", "TernGradCompressor"):
        cls = getattr(package, name)  # a class of the framework's compressor module, found by pickle
        assert (cls.__name__, cls.__module__) == (name, package.__name__ + ".compressor")
        assert pickle.loads(pickle.dumps(cls)) is cls
    default = package.AMQCompressor.default()
    assert default is package.AMQCompressor.default()  # one per class
    assert _method_name(default) == "amq" and default.bits == 3
    for name in ("compress", "decompress", "metrics"):  # the class as compression= runs its default's
        bound = getattr(package.AMQCompressor, name)
        assert bound.__self__ is default and bound.__doc__ == getattr(type(default), name).__doc__ is not None
        plain = next(vars(c)[name] for c in type(default).__mro__ if name in vars(c))
        assert getattr(default, name).__func__ is plain  # an instance's: a plain method


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.compressor_for("alq-x"), "unknown method 'alq-x'"),
        (lambda p: p.QSGDCompressor(norm="l1"), "norm must be 'linf' (QSGDinf) or 'l2' (QSGD), got 'l1'"),
        (lambda p: p.ALQCompressor(min_size=-1), "min_size must be a non-negative integer, got -1"),
        (lambda p: p.ALQCompressor(min_size=True), "min_size must be a non-negative integer, got True"),
        (lambda p: p.ALQCompressor(bits=9), "bits"),
        (lambda p: p.TernGradCompressor(bits=3), "TernGrad always sends 2 bits per coordinate, got bits=3"),
    ],
)
def test_bad_arguments_name_the_problem(package, make, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        make(package)


def test_compressor_module_not_shadowed(package):
    """``package.compressor`` stays the module (a function of that name once shadowed it)."""
    import types

    assert isinstance(package.compressor, types.ModuleType)
    assert package.compressor.compressor_for is package.compressor_for


@pytest.mark.parametrize(
    "make, norm",
    [
        (lambda p: p.ALQCompressor(norm="linf"), "linf"),
        (lambda p: p.ALQCompressor(norm="l2", normless=True), "l2"),
        (lambda p: p.AMQCompressor(norm="linf", bits=2), "linf"),
        (lambda p: p.compressor_for("amq-n", norm="linf"), "linf"),
        (lambda p: p.compressor_for("alq", norm="l2"), "l2"),
        (lambda p: p.compressor_for("qsgdinf", norm="linf"), "linf"),  # its own norm: accepted
        (lambda p: p.compressor_for("terngrad", norm=None), "linf"),
        (lambda p: p.NUQSGDCompressor(), "l2"),
    ],
)
def test_norm_keyword(package, make, norm):
    """norm= reaches the core quantizer of the adaptive methods; levels start where the core's do."""
    comp = make(package)
    assert comp.norm == comp._quantizer.norm == norm
    q = Quantizer(comp._method.name, bits=comp.bits, bucket_size=comp.bucket_size, norm=norm)
    np.testing.assert_array_equal(comp.levels, q.levels)
    assert comp.state_dict()["quantizer"]["norm"] == norm


def test_default_norm(package):
    for name in ("ALQCompressor", "AMQCompressor"):
        comp = getattr(package, name)()
        assert comp.norm == METHODS[comp._method.name].norm


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.ALQCompressor(norm="l1"), "norm must be one of 'l2', 'linf'"),
        (lambda p: p.AMQCompressor(norm=2), "norm must be one of 'l2', 'linf'"),
        (lambda p: p.compressor_for("qsgdinf", norm="l2"), "qsgdinf has fixed norm 'linf'"),
        (lambda p: p.compressor_for("nuqsgd", norm="linf"), "nuqsgd has fixed norm 'l2'"),
        (lambda p: p.TernGradCompressor(norm="l2"), "terngrad has fixed norm 'linf'"),
    ],
)
def test_bad_norm_names_the_allowed_values(package, make, message):
    with pytest.raises(ValueError, match=message):
        make(package)


def test_state_with_another_norm_is_refused(package):
    a, b = package.ALQCompressor(norm="linf"), package.ALQCompressor(norm="l2")
    with pytest.raises(ValueError, match="state has norm='linf', this quantizer has norm='l2'"):
        b.load_state_dict(a.state_dict())
    package.ALQCompressor(norm="linf").load_state_dict(a.state_dict())


def test_bits_second_of_other_width(package):
    """Fixed methods take any second width; ALQ/AMQ take one too and adapt its levels (in
    TensorFlow since the second levels refit there: tests/tensorflow, the two-phase scenario)."""
    package.QSGDCompressor(bits=3, bits_second=4)
    assert len(package.ALQCompressor(bits=3, bits_second=4).state_dict()["second"]["levels"]) == 16


def test_tensorflow_protocol_errors_are_horovods_error_type():
    """Eagerly a TensorFlow compressor's protocol error is a FailedPreconditionError (Horovod's error
    type in TensorFlow), a RuntimeError, and the core's ProtocolError / ReductionMismatch."""
    tf = pytest.importorskip("tensorflow")
    import horovod_alq.tensorflow as compressor
    from horovod_alq.core import protocol

    err = compressor.ReductionMismatch("horovod_alq: test")
    for cls in (
        tf.errors.FailedPreconditionError,
        RuntimeError,
        protocol.ProtocolError,
        protocol.ReductionMismatch,
        compressor.ProtocolError,
    ):
        assert isinstance(err, cls), cls
    assert str(err) == "horovod_alq: test" and err.error_code == tf.errors.FAILED_PRECONDITION

    def raise_(_):
        raise compressor.ProtocolError("horovod_alq: raised inside numpy_function")

    with pytest.raises(tf.errors.FailedPreconditionError, match="inside numpy_function"):
        tf.numpy_function(raise_, [tf.constant(1.0)], tf.float32, stateful=True)


def test_auto_bits_on_the_horovod_compressors(package):
    comp = package.AMQCompressor(bits="auto", bit_budget=2.5, normless=True)
    assert comp.bits == "auto" and comp.bit_budget == 2.5 and comp._method.name == "amq-n"
    if not package.__name__.endswith("tensorflow"):  # (TF's metrics() read Horovod's process set)
        m = comp.metrics()
        assert m["allocation"] == [] and m["bit_budget"] == 2.5 and m["default_bits"] == 2
    assert package.ALQCompressor().bit_budget is None
    assert package.compressor_for("alq", bits="auto").bit_budget == 3.0
    with pytest.raises(ValueError, match="adaptive method"):
        package.QSGDCompressor(bits="auto")
    with pytest.raises(ValueError, match="bit_budget applies to bits='auto' only"):
        package.ALQCompressor(bit_budget=3.0)
