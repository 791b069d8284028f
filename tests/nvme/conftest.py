"""Fixtures: kvtool's userspace target on 127.0.0.1 (ephemeral port), in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from emulator.nvmetcp import EmulatorConfig, NamespaceConfig, SubsystemConfig, Target

NQN = "nqn.2026-01.io.kvtool:test"
NQN4K = "nqn.2026-01.io.kvtool:test4k"
HOST_A = "nqn.2026-01.io.kvtool:host-a"
HOST_B = "nqn.2026-01.io.kvtool:host-b"
HOST_C = "nqn.2026-01.io.kvtool:host-c"
STRANGER = "nqn.2026-01.io.kvtool:stranger"


def make_config(**limits: object) -> EmulatorConfig:
    """Two subsystems; in-capsule data capped at 8 KiB (unless given) so that writes above
    it take the R2T/H2CData path these tests are about."""
    limits.setdefault("in_capsule_data_size", 8192)
    return EmulatorConfig(
        subsystems=[
            SubsystemConfig(NQN, [NamespaceConfig(1, "64MiB"), NamespaceConfig(2, "8MiB")],
                            hosts=[HOST_A, HOST_B, HOST_C]),
            SubsystemConfig(NQN4K, [NamespaceConfig(1, "32MiB", lba_size=4096)],
                            hosts=[HOST_A]),
        ],
        listen=["127.0.0.1:0"], **limits)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target(make_config(kato_grace_s=0.3)).start_in_thread()
    yield t
    t.stop()
