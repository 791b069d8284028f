"""Fuzzing the target's PDU parser and state machine: no crash, no hang, TermReq on bad input.

Most inputs go straight into the connection's state machine (no sockets; see
emulator/nvmetcp/fuzz.py for the invariants checked after each input); a smaller set
goes through real sockets to a running target, which must keep serving a good host.
"""

from __future__ import annotations

import random
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator.nvmetcp import Target, simple_config
from emulator.nvmetcp.fuzz import HOSTNQN, NQN, Harness, mutate, run_fuzz, seed_sessions
from kvtool.nvme import host


@pytest.fixture(scope="module")
def harness() -> Harness:
    h = Harness()
    yield h  # type: ignore[misc]
    h.close()


def test_valid_sessions_run_cleanly(harness: Harness) -> None:
    rng = random.Random(0)
    for session in seed_sessions(rng):
        out = harness.run(session, rng)
        assert out and out[0] == 0x01  # ICResp first
    assert harness.stats.failures == []
    assert harness.stats.terminated == 0


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(data=st.data())
def test_hypothesis_streams(harness: Harness, data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    corpus = seed_sessions(random.Random(1))
    choice = data.draw(st.sampled_from(["raw", "prefix", "mutant"]))
    if choice == "raw":
        stream = data.draw(st.binary(min_size=1, max_size=2048))
    elif choice == "prefix":  # a valid prefix followed by arbitrary bytes
        base = data.draw(st.sampled_from(corpus))
        stream = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.binary(max_size=512))
    else:
        stream = mutate(data.draw(st.sampled_from(corpus)), rng, corpus)
    harness.run(stream, rng)
    assert harness.stats.failures == []


def test_seeded_mutator_quick(harness: Harness) -> None:
    stats = run_fuzz(3000, seed=7, harness=harness)
    assert stats.failures == []
    assert stats.terminated > 500  # most mutants are caught by TermReq


@pytest.mark.slow
def test_seeded_mutator_100k() -> None:
    """100,000 malformed inputs (≈ 30 s on one core); see bench/nvme_fuzz.py for more."""
    stats = run_fuzz(100_000, seed=20261129)
    assert stats.failures == [], stats.failures[:5]
    assert stats.inputs >= 100_000


@pytest.mark.integration
def test_socket_level_fuzz_server_survives() -> None:
    target = Target(simple_config(nqn=NQN, backing="1MiB", hosts=[HOSTNQN],
                                  listen=["127.0.0.1:0"])).start_in_thread()
    try:
        rng = random.Random(99)
        corpus = seed_sessions(rng)
        for i in range(200):
            stream = mutate(corpus[i % len(corpus)], rng, corpus)
            with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
                try:
                    s.sendall(stream)
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(5)
                    while s.recv(65536):
                        pass
                except (ConnectionResetError, BrokenPipeError):
                    pass
        with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOSTNQN) as ctrl:
            ctrl.write(1, 0, b"ok" * 256)
            assert ctrl.read(1, 0, 1) == b"ok" * 256
    finally:
        target.stop()
