"""The target's hot path (``QueueConnection._hot``: canonical small Reads and in-capsule
Writes answered without the general dispatch) against the general path: the same input
must give the same bytes on the wire, the same namespace contents, SMART counters and
Error Information log, whether the hot path is on or off. Conformance against Linux
nvmet and SPDK (tests/emulator/test_conformance.py, test_sweep.py, tests/spdk) runs with
it on, as every target does."""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator.nvmetcp import nvm
from emulator.nvmetcp.fuzz import HOSTNQN, NQN, Harness, io_hot_session, mutate, seed_sessions
from kvtool.nvme import dhchap, spec
from kvtool.nvme import pdu as P


class _Secrets:
    """``secrets`` for kvtool.nvme.dhchap, replayable: the DH-HMAC-CHAP challenge of the
    auth sessions is random, and both paths must see the same one."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def token_bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def randbelow(self, n: int) -> int:
        return self.rng.randrange(n)

    def randbits(self, k: int) -> int:
        return self.rng.getrandbits(k)


@pytest.fixture(autouse=True)
def replayable_secrets(monkeypatch: pytest.MonkeyPatch) -> _Secrets:
    fake = _Secrets()
    monkeypatch.setattr(dhchap, "secrets", fake)
    return fake


@pytest.fixture
def pair() -> Iterator[tuple[Harness, Harness]]:
    hot, general = Harness(hot_path=True), Harness(hot_path=False)
    yield hot, general
    general.close()  # last made, first closed: each restores the log level it found
    hot.close()


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts commands the hot path answered: [reads, writes]."""
    counts = [0, 0]
    read, write = nvm.hot_read, nvm.hot_write

    def counting_read(*args: object) -> bytes | None:
        out = read(*args)  # type: ignore[arg-type]
        counts[0] += out is not None
        return out

    def counting_write(*args: object) -> bool:
        ok = write(*args)  # type: ignore[arg-type]
        counts[1] += ok
        return ok

    monkeypatch.setattr(nvm, "hot_read", counting_read)
    monkeypatch.setattr(nvm, "hot_write", counting_write)
    return counts


def _state(h: Harness) -> tuple[bytes, tuple[int, ...], list[object]]:
    ns = h.state.subsystems[NQN].namespaces[1]
    s = ns.smart
    ctrl = next(iter(h.state.subsystems[NQN].controllers.values()))
    return (ns.backing.read(0, ns.backing.size),
            (s.bytes_read, s.reads, s.bytes_written, s.writes),
            list(ctrl.errors))


def _same(pair: tuple[Harness, Harness], stream: bytes, seed: int) -> bytes:
    hot, general = pair
    fake = dhchap.secrets
    assert isinstance(fake, _Secrets)
    fake.rng.seed(seed)
    out = hot.run(stream, random.Random(seed))
    fake.rng.seed(seed)
    assert out == general.run(stream, random.Random(seed))
    assert _state(hot) == _state(general)
    return out


def test_hot_session_same_bytes_and_state(pair: tuple[Harness, Harness],
                                          taken: list[int]) -> None:
    for sqflow in (True, False):
        out = _same(pair, io_hot_session(random.Random(3), sqflow=sqflow), 5)
        assert P.PduType.C2H_DATA in out  # reads answered
    assert pair[0].stats.failures == pair[1].stats.failures == []
    assert pair[0].stats.terminated == 0
    # per session, reads: 4 of 8 (not past the end, NLB disagreeing with the SGL, past
    # MDTS, another namespace); writes: 3 of 7 (not past the end, FUA, NLB disagreeing
    # with the data, another namespace)
    assert taken == [2 * 4, 2 * 3]
    assert _state(pair[0])[2]  # the near misses failed and were logged, on both paths


def test_seeded_mutants_same_bytes(pair: tuple[Harness, Harness], taken: list[int]) -> None:
    rng = random.Random(40)
    corpus = seed_sessions(rng)
    for i in range(2000):
        _same(pair, mutate(corpus[i % len(corpus)], rng, corpus), i)
    assert pair[0].stats.failures == pair[1].stats.failures == []
    assert taken[0] > 50 and taken[1] > 50  # the hot path was reached


def _capsule(sqe: P.Sqe, data: bytes = b"", transport_len: int = 0) -> bytes:
    sqe.sgl = (P.SglDescriptor.in_capsule(len(data)) if data
               else P.SglDescriptor.transport(transport_len))
    return P.encode(P.CapsuleCmd(sqe, data))


def _connect(cattr: int) -> bytes:
    """Fabrics Connect of I/O queue 1 to the harness's controller 1, SQSIZE 7."""
    data = spec.ConnectData(bytes(16), 1, NQN, HOSTNQN).encode()
    return _capsule(P.Sqe(spec.OPC_FABRICS, cid=0, nsid=spec.FCTYPE_CONNECT, cdw10=1 << 16,
                          cdw11=7 | (cattr << 16)), data)


_W, _R = spec.IO_WRITE, spec.IO_READ
_LAST = (1 << 20) // 512 - 1


@st.composite
def _command(draw: st.DrawFn) -> bytes:
    """One Read or Write capsule with fields near every boundary the checks draw."""
    op = draw(st.sampled_from([_R, _W, _W, spec.IO_FLUSH, 0x7C]))
    nlb = draw(st.sampled_from([1, 2, 4, 8, 128, 129, 65536]))
    slba = draw(st.sampled_from([0, 8, _LAST - 3, _LAST, _LAST + 1, 1 << 32]))
    n = nlb * 512 + draw(st.sampled_from([0, 0, 0, -512, 512]))
    sqe = P.Sqe(op, cid=draw(st.integers(0, 9)), nsid=draw(st.sampled_from([1, 1, 0, 2])),
                cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                cdw12=((nlb - 1) & 0xFFFF) | draw(st.sampled_from([0, 0, 1 << 30])))
    incap = op == _W and 0 < n <= 4096 and draw(st.booleans())
    raw = bytearray(_capsule(sqe, bytes(range(256)) * (n // 256) if incap else b"",
                             transport_len=max(n, 0)))
    if draw(st.booleans()):  # a near-canonical header: one byte of flags, SGL or PSDT
        pos, value = draw(st.sampled_from([(1, 1), (9, 0x41), (9, 0), (39, 0x01), (39, 0x5A),
                                           (39, 0x00), (24, 4)]))
        struct.pack_into("B", raw, pos, value)
    return bytes(raw)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cmds=st.lists(_command(), min_size=1, max_size=12), sqflow=st.booleans(),
       seed=st.integers(0, 2**16))
def test_generated_commands_same_bytes(cmds: list[bytes], sqflow: bool, seed: int) -> None:
    stream = (P.encode(P.ICReq()) + _connect(0 if sqflow else spec.CATTR_DISABLE_SQ_FLOW)
              + b"".join(cmds))
    hot, general = Harness(hot_path=True), Harness(hot_path=False)
    try:
        _same((hot, general), stream, seed)
        assert hot.stats.failures == []
    finally:
        general.close()
        hot.close()


@pytest.mark.parametrize("ana", [spec.ANA_INACCESSIBLE, spec.ANA_NON_OPTIMIZED])
def test_ana_states_same_bytes(pair: tuple[Harness, Harness], taken: list[int],
                               ana: int) -> None:
    """An inaccessible group refuses I/O with a path error (general path); a
    non-optimized one serves it (hot path) — the same bytes either way."""
    for h in pair:
        h.state.set_ana({0: {1: ana}})
    _same(pair, io_hot_session(random.Random(4)), 6)
    assert (sum(taken) > 0) == (ana == spec.ANA_NON_OPTIMIZED)


def test_harnesses_leave_the_log_level_as_found() -> None:
    logger = logging.getLogger("emulator.nvmetcp")
    before = logger.level
    hot, general = Harness(hot_path=True), Harness(hot_path=False)
    general.close()
    hot.close()
    assert logger.level == before
