"""Differential conformance harness: scripted host behaviours against an NVMe/TCP target.

``python -m emulator.nvmetcp.conformance HOST:PORT NQN [--against HOST:PORT NQN]``

Each case opens its own connection(s) with :class:`RawHost` — a host that sends exactly
the bytes a case asks for, SGL forms, digests and mistakes included — and reduces what the
target answered to an :class:`Outcome`: the CQE status (SCT, SC, DNR), the result fields
that matter and the data fields that matter, or how the connection ended. Against two
targets (``--against``) the outcomes are compared case by case; ``--markdown`` prints the
table that docs/nvme-tcp.md carries. The reference target is Linux nvmet (the QEMU guest:
``python -m emulator.qemu run``); tests/emulator/test_conformance.py runs both in one go.

The target must let this host's NQN connect, serve namespace 1 (≥ 1 MiB, writable: the
cases write to it) and answer on a data subsystem ``NQN``.

The package: :mod:`.host` (the scripted host and its outcomes), :mod:`.cases` (the cases),
:mod:`.reasons` (why kvtool differs from Linux where it does), :mod:`.run` (running,
tables, the command line), :mod:`.sweep` (the generated sweep of every feature, Identify
CNS and log page, against kvtool, Linux nvmet 6.1/6.12 and SPDK).
"""

from emulator.nvmetcp.conformance.cases import CASES, Case, case
from emulator.nvmetcp.conformance.host import (
    HOSTID,
    HOSTNQN,
    Closed,
    Outcome,
    ProtocolViolation,
    RawHost,
    Reply,
    Session,
    Target,
)
from emulator.nvmetcp.conformance.reasons import REASONS
from emulator.nvmetcp.conformance.run import main, markdown, parse_addr, run_all, run_case

__all__ = ["CASES", "HOSTID", "HOSTNQN", "REASONS", "Case", "Closed", "Outcome",
           "ProtocolViolation", "RawHost", "Reply", "Session", "Target", "case", "main",
           "markdown", "parse_addr", "run_all", "run_case"]
