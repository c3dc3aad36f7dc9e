"""``wire="entropy"`` through every exchange on threaded ranks (nodes of 2 for the hierarchical
ones): the same results as the fixed wire, bit for bit, for fewer bytes; a rank on another wire
refused on every rank before any payload moves; a corrupted frame refused, never decoded."""

import threading

import numpy as np
import pytest

from horovod_alq.core import entropy
from horovod_alq.core.protocol import ProtocolError
from horovod_alq.exchange.entropy_wire import EntropyTransport
from horovod_alq.exchange.numpy_ops import NumpyOps
from horovod_alq.exchange.registry import allreduce_names
from horovod_alq.settings import Settings, configure
from horovod_alq.testing import Hub, exchange_rounds

D = 256
SIZES = (5000, 3000, 1500)


def _grads(step, rank):
    rng = np.random.default_rng(100 * step + rank)
    return [(rng.standard_t(3, n) * (1 + rank)).astype(np.float32) for n in SIZES]


def _rounds(exchange, wires, rounds=2, n=4, g=2, bits=3):
    """``rounds`` rounds on ``n`` ranks, rank r on ``wires[r]``; every rank's outputs (or error) and engines."""
    setups = [
        configure(Settings("alq", bits=bits, bucket_size=D, seed=7, exchange=exchange, wire=w, update_steps=(0,)))
        for w in wires
    ]
    engines = [s.engine(uid="e") for s in setups]
    tensors = [[_grads(step, r) for r in range(n)] for step in range(rounds)]
    return exchange_rounds(engines, tensors, NumpyOps(), Hub(n, local_size=g)), engines


@pytest.mark.parametrize("exchange", sorted(allreduce_names()))
def test_same_results_as_the_fixed_wire_for_fewer_bytes(exchange):
    fixed, _ = _rounds(exchange, ["fixed"] * 4)
    coded, engines = _rounds(exchange, ["entropy"] * 4)
    for r in range(4):
        assert not isinstance(coded[r], Exception), coded[r]
        for a_round, b_round in zip(fixed[r], coded[r]):
            for a, b in zip(a_round, b_round):
                np.testing.assert_array_equal(a, b)
    sent = [(e.state.wire_fixed_bytes, e.state.wire_coded_bytes) for e in engines]
    assert all(fixed > 0 for fixed, _ in sent)
    # heavy-tailed gradients at 3 bits with fitted levels: codes well below 3 bits of entropy; the
    # hierarchical exchanges also move float32 sums inside the node (raw frames: 32 bytes more), and
    # in their last stage each rank's status byte to the 2 ranks of the other node (a raw frame each:
    # 33 bytes), counted out here: 4 ranks, 2 rounds of one buffer
    bound = 0.99 if exchange.startswith("hierarchical") else 0.9
    status = 4 * 2 * 2 if exchange.startswith("hierarchical") else 0
    coded = sum(c for _, c in sent) - status * (entropy.FRAME_HEADER + 1)
    assert coded < bound * (sum(f for f, _ in sent) - status), sent


def test_bytes_sent_and_received_are_the_coded_bytes():
    """``bytes_sent`` / ``bytes_received`` count what went on the wire: in the allgather exchange
    each rank's frames reach the 3 others, and it receives the others' frames."""
    fixed, f_engines = _rounds("allgather", ["fixed"] * 4)
    coded, engines = _rounds("allgather", ["entropy"] * 4)
    coded_bytes = [e.state.wire_coded_bytes for e in engines]
    for r, e in enumerate(engines):
        assert e.state.bytes_sent == 3 * coded_bytes[r] < f_engines[r].state.bytes_sent, (r, e.state)
        assert e.state.bytes_received == sum(coded_bytes) - coded_bytes[r], (r, e.state)
        assert f_engines[r].state.bytes_sent == 3 * e.state.wire_fixed_bytes  # the fixed wire's count


def test_a_rank_on_another_wire_is_refused_on_every_rank():
    out, engines = _rounds("allgather", ["entropy", "entropy", "fixed", "entropy"], rounds=1)
    assert all(isinstance(o, ProtocolError) for o in out), out
    assert all("wire fixed on some ranks, entropy on others" in str(o) for o in out), out[0]
    assert all(e.state.wire_fixed_bytes == 0 for e in engines)  # refused before any payload moved


class _Corrupting:
    """A transport that flips one byte of what rank 0 sends in its allgathers."""

    def __init__(self, inner, rank):
        self.inner, self.rank, self.size, self.local_size = inner, inner.rank, inner.size, inner.local_size

    def allgather(self, payload, sizes, name):
        payload = np.array(payload, copy=True)
        if self.rank == 0 and payload.size > 200:
            payload[payload.size // 2] ^= 0x10
        return self.inner.allgather(payload, sizes, name)

    def alltoall(self, payload, splits, received, name):
        return self.inner.alltoall(payload, splits, received, name)

    def allreduce_sum(self, vec, name):
        return self.inner.allreduce_sum(vec, name)

    def allreduce_max(self, vec, name):
        return self.inner.allreduce_max(vec, name)


def test_a_corrupted_frame_raises_on_every_rank():
    hub = Hub(2)
    ops = NumpyOps()
    from horovod_alq.core.quantizer import Quantizer

    q = Quantizer("alq", bits=3, bucket_size=D, seed=1)
    x = np.random.default_rng(0).standard_t(3, 4000).astype(np.float32)

    def rank(r, t):
        wire = EntropyTransport(_Corrupting(t, r), ops)
        return wire.allgather(q.encode(x), [q.payload_bytes(x.size)] * 2, "ag")()

    out = hub.outcomes(rank)
    assert all(isinstance(o, ProtocolError) for o in out), out
    assert all("rank 0's entropy-coded payloads" in str(o) and "checksum" in str(o) for o in out), out


def test_the_wire_setting_is_checked():
    with pytest.raises(ValueError, match="wire must be one of 'fixed', 'entropy', got 'rans'"):
        Settings(wire="rans")
    assert entropy.check_wire("entropy") == "entropy"


# ------------------------------------------------------------------ a coder bug on one rank
class _Faulty:
    """Rank 0's coder (``entropy.encode_streams``) broken in one of three ways, other ranks' intact."""

    def __init__(self, kind):
        self.kind, self.local = kind, threading.local()
        self.real = entropy.encode_streams

    def __call__(self, codes, n, d, bits, freq):
        if not getattr(self.local, "faulty", False):
            return self.real(codes, n, d, bits, freq)
        if self.kind == "raises":
            raise RuntimeError("injected coder fault")
        if self.kind == "other-bytes":  # two different codes swapped: a clean frame of other codes
            codes = np.array(codes, copy=True)
            j = int(np.flatnonzero(codes != codes[0])[0])
            codes[0], codes[j] = codes[j], codes[0]
            return self.real(codes, n, d, bits, freq)
        lengths, streams = self.real(codes, n, d, bits, freq)
        streams = np.array(streams, copy=True)
        streams[0] ^= 0x5A  # a final state of bucket 0: the stream no longer ends where it began
        return lengths, streams


@pytest.mark.parametrize("kind", ["other-bytes", "undecodable", "raises"])
def test_a_senders_coder_bug_raises_on_every_rank_the_sender_included(monkeypatch, kind):
    """Rank 0's frames come from a broken coder: a frame of other codes (it decodes cleanly, so
    only the sender can tell), a frame that does not decode, or a coder that raises. The sender
    checks its frames before it sends them and sends a refused frame naming the error, so every
    rank raises the same ProtocolError: none decodes other bytes, none waits for a timeout."""
    from horovod_alq.core.quantizer import Quantizer

    faulty = _Faulty(kind)
    monkeypatch.setattr(entropy, "encode_streams", faulty)
    q = Quantizer("alq", bits=3, bucket_size=D, seed=1)
    hub = Hub(2, timeout=5.0)

    def rank(r, t):
        faulty.local.faulty = r == 0
        x = np.random.default_rng(r).standard_t(3, 4000).astype(np.float32)
        wire = EntropyTransport(t, NumpyOps())
        return wire.allgather(q.encode(x), [q.payload_bytes(x.size)] * 2, "ag")()

    out = hub.outcomes(rank)
    assert all(isinstance(o, ProtocolError) for o in out), out
    why = {"other-bytes": "decoded CRC mismatch", "undecodable": "rank 0: ValueError: ",
           "raises": "rank 0: RuntimeError: injected coder fault"}[kind]  # fmt: skip
    for o in out:
        assert "rank 0's entropy-coded payloads" in str(o) and "refused" in str(o) and why in str(o), o


@pytest.mark.filterwarnings("ignore:horovod_alq.*do not decode:RuntimeWarning")
@pytest.mark.parametrize("kind", ["other-bytes", "raises"])
def test_an_alltoall_frame_of_a_faulty_coder_fails_its_receiver_and_its_sender(monkeypatch, kind):
    """In an alltoall only the receiver decodes a frame: one that decodes to other codes fails the
    CRC of the decoded bytes there, and a sender whose coder raised refuses its own share too;
    each substitutes 0xFF bytes, which fail the exchange's payload check (bad magic), whose
    poisoning makes every rank raise (tests/mpi/test_entropy_faults.py on real ranks)."""
    from horovod_alq.core.quantizer import Quantizer

    faulty = _Faulty(kind)
    monkeypatch.setattr(entropy, "encode_streams", faulty)
    q = Quantizer("alq", bits=3, bucket_size=D, seed=1)
    hub = Hub(2, timeout=5.0)

    def rank(r, t):
        faulty.local.faulty = r == 0
        p = q.encode(np.random.default_rng(r).standard_t(3, 4000).astype(np.float32))
        got = EntropyTransport(t, NumpyOps()).alltoall(np.concatenate([p, p]), [p.size] * 2, [p.size] * 2, "a2a")()
        return [bytes(got[k * p.size : k * p.size + 2]) for k in range(2)]

    out = hub.outcomes(rank)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert out[1] == [b"\xff\xff", b"AQ"], out  # rank 0's frame refused where it arrived
    assert out[0] == ([b"\xff\xff", b"AQ"] if kind == "raises" else [b"AQ", b"AQ"]), out


def _coded_claiming(decoded_claim: int) -> np.ndarray:
    """A well-formed coded frame (CRCs right) whose payload header claims about ``decoded_claim``
    bytes of codes: buckets of 2**32 - 1, each stream a bare pair of states."""
    from horovod_alq.core import wire

    d, bits = (1 << 32) - 1, 3
    n = ((decoded_claim * 8) // bits) // d * d
    b = wire.num_buckets(n, d)
    head = wire.pack_header(wire.Header(method_id=1, bits=bits, bucket_size=d, numel=n, fingerprint=0))
    freq = np.zeros(1 << bits, "<u2")
    freq[0] = entropy.PROB_SCALE
    states = np.tile(np.frombuffer(int(entropy.RANS_L).to_bytes(4, "little") * 2, np.uint8), b)
    body = [np.frombuffer(head, np.uint8), np.ones(b, "<f4"), freq, np.full(b, 8, "<u4"), states]
    return entropy._frame(entropy.CODED, body, wire.payload_size(n, bits, d))


def test_a_frame_claiming_more_than_the_exchange_expects_raises_before_allocating():
    """A small, well-formed frame whose header claims 2**48 decoded bytes: every rank refuses it as
    a protocol error naming the sizes, before allocating what it claims (no MemoryError)."""
    from horovod_alq.core.quantizer import Quantizer

    frame = _coded_claiming(1 << 48)
    assert frame.size < 4 << 20
    with pytest.raises(ValueError, match=r"states \d+ decoded bytes, the exchange expects at most 4000"):
        entropy.decode_wire(frame, 4000)

    class Claiming(_Corrupting):
        """Rank 0 sends the frame (and its size) in place of its own."""

        def allgather(self, payload, sizes, name):
            if self.rank == 0:
                payload = np.asarray([frame.size], "<i8").view(np.uint8) if name.endswith(".sizes") else frame
            return self.inner.allgather(payload, sizes, name)

    q = Quantizer("alq", bits=3, bucket_size=D, seed=1)

    def rank(r, t):
        p = q.encode(np.random.default_rng(r).standard_t(3, 1000).astype(np.float32))
        return EntropyTransport(Claiming(t, r), NumpyOps()).allgather(p, [p.size] * 2, "ag")()

    out = Hub(2, timeout=5.0).outcomes(rank)
    assert all(isinstance(o, ProtocolError) for o in out), out
    assert all("rank 0's entropy-coded payloads" in str(o) and "expects at most" in str(o) for o in out), out


def test_the_numpy_decoder_allocates_by_the_codes_not_the_bucket_size():
    """A one-bucket payload whose bucket size is far above its codes (2**40 here) decodes: the
    reference decoder's working array has a column per code, not per bucket slot."""
    from horovod_alq.core.packing import pack_codes

    codes = np.random.default_rng(0).integers(0, 8, 900)
    packed = pack_codes(codes.astype(np.uint8), 3)
    freq = entropy.quantized_frequencies(np.bincount(codes, minlength=8)).astype("<u2")
    kernel = entropy._KERNEL
    entropy.use_kernel(None)
    try:
        lengths, streams = entropy.encode_streams(packed, 900, 1024, 3, freq)
        out = entropy.decode_streams(streams, lengths, 900, 1 << 40, 3, freq)
    finally:
        entropy.use_kernel(kernel)
    np.testing.assert_array_equal(out, packed)
