"""The generated sweep: every Get Features FID 01h–1Fh and the ones host tools read above
it, every Identify CNS 00h–1Fh, every log page ID 00h–1Fh and those host tools read, and
Set Features of the mandatory features, each sent once on one admin queue and reduced to
an :class:`Outcome` (status; CQE DW0 for features; whether the data was all zeros).

``python -m emulator.nvmetcp.conformance.sweep HOST:PORT NQN [--json]``

Unlike the cases, the sweep is generated, not written: a probe is (family, code) plus the
command it sends, so a feature or page that a target starts or stops answering shows up
without anyone thinking to ask. tests/emulator/test_sweep.py runs it against kvtool's
target, Linux nvmet 6.1 and 6.12 (QEMU guests) and SPDK's nvmf_tgt and compares each with
the recorded table (fixtures/conformance/sweep.json); docs/nvme-tcp.md carries that table.

Invariants: probes run in a fixed order on one controller (a probe that closes the
connection opens a new one for the next); Set Features come last and set only what a
host would (values a fresh controller reports, or the spec's defaults), so the Get sweep
sees a fresh controller.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from emulator.nvmetcp.conformance.host import (
    Closed,
    Outcome,
    ProtocolViolation,
    Reply,
    Session,
    Target,
    admin_cmd,
    closed,
    get_log,
    identify,
    status_text,
)
from emulator.nvmetcp.conformance.run import parse_addr
from kvtool.nvme import spec

NSID_ALL = 0xFFFFFFFF

FEATURE_NAMES = {
    0x01: "Arbitration", 0x02: "Power Management", 0x03: "LBA Range Type",
    0x04: "Temperature Threshold", 0x05: "Error Recovery", 0x06: "Volatile Write Cache",
    0x07: "Number of Queues", 0x08: "Interrupt Coalescing",
    0x09: "Interrupt Vector Configuration", 0x0A: "Write Atomicity Normal",
    0x0B: "Asynchronous Event Configuration", 0x0C: "Autonomous Power State Transition",
    0x0D: "Host Memory Buffer", 0x0E: "Timestamp", 0x0F: "Keep Alive Timer",
    0x10: "Host Controlled Thermal Management", 0x11: "Non-Operational Power State Config",
    0x12: "Read Recovery Level Config", 0x13: "Predictable Latency Mode Config",
    0x14: "Predictable Latency Mode Window", 0x16: "Host Behavior Support",
    0x17: "Sanitize Config", 0x18: "Endurance Group Event Configuration",
    0x19: "I/O Command Set Profile", 0x1A: "Spinup Control", 0x1B: "Power Loss Signaling",
    0x1D: "Flexible Data Placement", 0x1E: "FDP Events",
    0x1F: "Namespace Admin Label", 0x7D: "Enhanced Controller Metadata",
    0x7E: "Controller Metadata", 0x7F: "Namespace Metadata",
    0x80: "Software Progress Marker", 0x81: "Host Identifier",
    0x82: "Reservation Notification Mask", 0x83: "Reservation Persistence",
    0x84: "Namespace Write Protection Config", 0xC0: "vendor C0h (OCSSD Media Feedback)",
}
# Above 1Fh: NVMe-MI's metadata features nvme-cli reads, the host-side and reservation
# features, and C0h, which spdk_nvme_identify asks every controller for.
GET_FIDS = [*range(0x01, 0x20), 0x7D, 0x7E, 0x7F, 0x80, 0x81, 0x82, 0x83, 0x84, 0xC0]
# Get Features data lengths where the feature returns a data structure (Base 2.1, Figure
# "Feature Identifiers"; what nvme-cli's get-feature asks for).
FEATURE_DATA = {0x03: 4096, 0x0C: 256, 0x0D: 4096, 0x0E: 8, 0x13: 512, 0x16: 512,
                0x81: 16}
FEATURE_CDW11 = {0x81: 1}  # EXHID: fabrics use the 128-bit host identifier
# Namespace-scoped features are asked for namespace 1, the others for NSID 0.
NS_FEATURES = {0x03, 0x05, 0x0A, 0x1F, 0x7F, 0x82, 0x83, 0x84}
# DW0 that depends on how the target was set up (its queue count), not on what it
# implements: shown, not compared.
CONFIG_DW0 = {0x07}
# Set Features the specification makes mandatory for an I/O controller on a fabric (and
# Volatile Write Cache, mandatory when VWC is 1), with the value a host sets.
# (Async Event Configuration: what SPDK's host sets, the SMART critical warnings and both
# notices.)
SET_VALUES = {0x01: 0, 0x02: 0, 0x04: 0x0000_0157, 0x05: 0, 0x06: 1, 0x07: 0x0003_0003,
              0x0A: 0, 0x0B: 0x91F, 0x0F: 30000}

CNS_NAMES = {
    0x00: "Namespace", 0x01: "Controller", 0x02: "Active Namespace ID list",
    0x03: "Namespace Identification Descriptor list", 0x04: "NVM Set list",
    0x05: "I/O Command Set specific Namespace", 0x06: "I/O Command Set specific Controller",
    0x07: "Active Namespace ID list (I/O Command Set)",
    0x08: "I/O Command Set Independent Namespace", 0x09: "Format Index",
    0x0A: "Domain List", 0x10: "Allocated Namespace ID list",
    0x11: "Allocated Namespace", 0x12: "Namespace Attached Controller list",
    0x13: "Controller list", 0x14: "Primary Controller Capabilities",
    0x15: "Secondary Controller list", 0x16: "Namespace Granularity list", 0x17: "UUID list",
    0x18: "Domain list", 0x19: "Endurance Group list",
    0x1A: "Allocated Namespace ID list (I/O Command Set)",
    0x1B: "Allocated I/O Command Set specific Namespace",
    0x1C: "I/O Command Set data structure",
}
CNS_RANGE = range(0x00, 0x20)
NS_CNS = {0x00, 0x03, 0x05, 0x08, 0x11, 0x1B}  # asked for namespace 1, the others NSID 0

LOG_NAMES = {
    0x00: "Supported Log Pages", 0x01: "Error Information", 0x02: "SMART / Health",
    0x03: "Firmware Slot", 0x04: "Changed Namespace List", 0x05: "Commands Supported and "
    "Effects", 0x06: "Device Self-test", 0x07: "Telemetry Host-Initiated",
    0x08: "Telemetry Controller-Initiated", 0x09: "Endurance Group Information",
    0x0A: "Predictable Latency Per NVM Set", 0x0B: "Predictable Latency Event Aggregate",
    0x0C: "Asymmetric Namespace Access", 0x0D: "Persistent Event", 0x0E: "LBA Status",
    0x0F: "Endurance Group Event Aggregate", 0x10: "Media Unit Status",
    0x11: "Supported Capacity Configuration List", 0x12: "Feature Identifiers Supported "
    "and Effects", 0x13: "NVMe-MI Commands Supported and Effects",
    0x14: "Command and Feature Lockdown", 0x15: "Boot Partition", 0x16: "Rotational Media",
    0x17: "Dispersed Namespace Participating NVM Subsystems", 0x18: "Management Address "
    "List", 0x19: "Physical Interface Receiver Eye Opening", 0x1A: "Reachability Groups",
    0x1B: "Reachability Associations", 0x1C: "Changed Allocated Namespace List",
    0x1D: "FDP Configurations", 0x1E: "Reclaim Unit Handle Usage", 0x1F: "FDP Statistics",
    0x70: "Discovery", 0x80: "Reservation Notification", 0x81: "Sanitize Status",
    0xC0: "vendor C0h (OCP SMART)", 0xC2: "vendor C2h (Intel temperature)",
    0xCA: "vendor CAh (Intel SMART)",
}
LIDS = [*range(0x00, 0x20), 0x70, 0x80, 0x81, 0xC0, 0xC2, 0xCA]
# The page's length where a host reads a fixed one (Linux 6.1 refuses other lengths for
# SMART; the others are read whole); every other page is asked for 512 bytes.
LOG_LEN = {0x01: 256, 0x02: 512, 0x04: 4096, 0x05: 4096, 0x0C: 4096, 0x12: 1024,
           0x70: 1024}


@dataclass(frozen=True)
class Probe:
    """One generated command: ``family`` and ``code`` name it (``label``); ``send`` runs it
    on an enabled admin queue; ``facts`` reduces a successful reply."""

    family: str
    code: int
    name: str
    send: Callable[[Session], Reply]
    facts: Callable[[Reply], dict[str, object]]
    shown: Callable[[Reply], str] | None = None

    @property
    def label(self) -> str:
        width = 4 if self.code > 0xFF else 2
        return f"{self.family} {self.code:0{width}X}h {self.name}".rstrip()


def _dw0(reply: Reply) -> dict[str, object]:
    return {"dw0": hex(reply.cqe.dw0)}


def _nothing(reply: Reply) -> dict[str, object]:
    return {}


def _zeros(reply: Reply) -> dict[str, object]:
    return {"data": "zeros" if not any(reply.data) else "nonzero"}


def _get_feature(fid: int) -> Callable[[Session], Reply]:
    def send(s: Session) -> Reply:
        return admin_cmd(s, spec.ADMIN_GET_FEATURES, nsid=1 if fid in NS_FEATURES else 0,
                         cdw10=fid, cdw11=FEATURE_CDW11.get(fid, 0),
                         read=FEATURE_DATA.get(fid, 0))
    return send


def _set_feature(fid: int) -> Callable[[Session], Reply]:
    def send(s: Session) -> Reply:
        return admin_cmd(s, spec.ADMIN_SET_FEATURES, nsid=1 if fid in NS_FEATURES else 0,
                         cdw10=fid, cdw11=SET_VALUES[fid])
    return send


def _identify(cns: int) -> Callable[[Session], Reply]:
    def send(s: Session) -> Reply:
        return identify(s, cns, 1 if cns in NS_CNS else 0)
    return send


def _log(lid: int) -> Callable[[Session], Reply]:
    def send(s: Session) -> Reply:
        return get_log(s, lid, LOG_LEN.get(lid, 512), nsid=NSID_ALL)
    return send


def probes() -> list[Probe]:
    """Every probe, in the order they run (Get Features, Identify, log pages, Set
    Features)."""
    out = [Probe("Get Features", fid, FEATURE_NAMES.get(fid, "(reserved)"),
                 _get_feature(fid), _nothing if fid in CONFIG_DW0 else _dw0,
                 (lambda r: hex(r.cqe.dw0)) if fid in CONFIG_DW0 else None)
           for fid in GET_FIDS]
    out += [Probe("Identify CNS", cns, CNS_NAMES.get(cns, "(reserved)"), _identify(cns),
                  _zeros) for cns in CNS_RANGE]
    out += [Probe("Log page", lid, LOG_NAMES.get(lid, "(reserved)"), _log(lid), _zeros)
            for lid in LIDS]
    out += [Probe("Set Features", fid, FEATURE_NAMES[fid], _set_feature(fid), _nothing)
            for fid in SET_VALUES]
    return out


def reduce(probe: Probe, reply: Reply) -> Outcome:
    facts = probe.facts(reply) if reply.cqe.ok else {}
    note = f"dw0={probe.shown(reply)}" if probe.shown and reply.cqe.ok else ""
    return Outcome("status", status_text(reply.cqe),
                   tuple((k, str(v)) for k, v in facts.items()), note)


def run_sweep(t: Target, only: Iterable[Probe] | None = None) -> dict[str, Outcome]:
    """Every probe against ``t`` on one controller; label -> outcome."""
    results: dict[str, Outcome] = {}
    session: Session | None = None
    try:
        for probe in probes() if only is None else only:
            lost: Outcome | None = None
            try:
                if session is None:
                    session = Session(t)
                results[probe.label] = reduce(probe, probe.send(session))
            except Closed as exc:
                lost = closed(exc)
            except TimeoutError:
                lost = Outcome("no answer")
            except (ProtocolViolation, OSError, ValueError, struct.error) as exc:
                lost = Outcome("error", note=f"{type(exc).__name__}: {exc}")
            if lost is not None:  # the next probe starts on a new controller
                results[probe.label] = lost
                if session is not None:
                    session.close()
                session = None
    finally:
        if session is not None:
            session.close()
    return results


def text(o: Outcome) -> str:
    """An outcome as the table shows it: the compared part, then what is only shown."""
    if o.kind == "status" and o.note:
        return f"{o.text()} ({o.note})"
    return o.text()


def to_json(results: dict[str, Outcome]) -> dict[str, dict[str, object]]:
    """label -> {"status", and "facts", "kind", "note" where not empty / "status"}."""
    out: dict[str, dict[str, object]] = {}
    for k, o in results.items():
        entry: dict[str, object] = {"status": o.status}
        if o.facts:
            entry["facts"] = dict(o.facts)
        if o.kind != "status":
            entry["kind"] = o.kind
        if o.note:
            entry["note"] = o.note
        out[k] = entry
    return out


def from_json(doc: dict[str, dict[str, object]]) -> dict[str, Outcome]:
    out = {}
    for k, v in doc.items():
        facts = v.get("facts", {})
        assert isinstance(facts, dict)
        out[k] = Outcome(str(v.get("kind", "status")), str(v["status"]),
                         tuple((str(a), str(b)) for a, b in facts.items()),
                         str(v.get("note", "")))
    return out


def dump(targets: dict[str, dict[str, dict[str, object]]]) -> str:
    """The fixture's text: one line per probe, so a diff shows what changed."""
    lines = ['{"schema": "kvtool.sweep/1", "targets": {']
    for i, (name, column) in enumerate(targets.items()):
        lines.append(f" {json.dumps(name)}: {{")
        rows = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                for k, v in column.items()]
        lines.append(",\n".join(rows))
        lines.append(" }" + ("," if i < len(targets) - 1 else ""))
    lines.append("}}")
    return "\n".join(lines) + "\n"


# --- the recorded table -------------------------------------------------------------------

TARGETS = ("kvtool", "linux-6.1", "linux-6.12", "spdk")  # the table's columns, in order
REFERENCES = TARGETS[1:]
HEADINGS = {"kvtool": "kvtool", "linux-6.1": "Linux nvmet 6.1",
            "linux-6.12": "Linux nvmet 6.12", "spdk": "SPDK v26.05"}
_LABEL = re.compile(r"^(?P<family>.*?) (?P<code>[0-9A-F]{2,4})h (?P<name>.*)$")


DNR_ONLY = "DNR only: kvtool sets it, as Linux (SPDK sets none)"


def _without_dnr(o: Outcome) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    kind, st, facts = o.key()
    return kind, st.removesuffix(" (DNR)"), facts


def differences(table: dict[str, dict[str, Outcome]]) -> dict[str, list[str]]:
    """label -> the references kvtool answers differently from, a difference in the DNR
    bit alone not counted (``DNR_ONLY``: SPDK sets DNR on no admin error, Linux on every
    one, kvtool as Linux: the specification's "would fail again")."""
    out: dict[str, list[str]] = {}
    for label, ours in table["kvtool"].items():
        refs = [r for r in REFERENCES
                if r in table and _without_dnr(table[r][label]) != _without_dnr(ours)]
        if refs:
            out[label] = refs
    return out


def dnr_only(table: dict[str, dict[str, Outcome]]) -> set[str]:
    """The labels where kvtool differs from a reference in the DNR bit alone."""
    differs = differences(table)
    return {label for label, ours in table["kvtool"].items() if label not in differs
            and any(r in table and table[r][label].key() != ours.key() for r in REFERENCES)}


def markdown(table: dict[str, dict[str, Outcome]], reasons: dict[str, str]) -> str:
    """The sweep table: one row per probe, runs of neighbours (same family, consecutive
    codes) that answer alike on every target, for the same reason, merged into one."""
    cols = [c for c in TARGETS if c in table]
    differs, dnr = differences(table), dnr_only(table)
    lines = ["| probe | " + " | ".join(HEADINGS[c] for c in cols) + " | kvtool differs: why |",
             "|---" * (len(cols) + 2) + "|"]
    rows: list[tuple[str, str, int, int, str, tuple[str, ...], str]] = []
    for label in table["kvtool"]:
        m = _LABEL.match(label)
        assert m is not None, label
        cells = tuple(text(table[c][label]) for c in cols)
        why = (reasons.get(label, "**differs**") if label in differs
               else DNR_ONLY if label in dnr else "same")
        code = int(m["code"], 16)
        last = rows[-1] if rows else None
        if (last is not None and last[0] == m["family"] and last[3] == code - 1
                and last[5] == cells and last[6] == why):
            rows[-1] = (last[0], last[1], last[2], code, f"{last[4]}, {m['name']}", cells, why)
            continue
        rows.append((m["family"], label, code, code, m["name"], cells, why))
    for family, label, first, last_code, names, cells, why in rows:
        if first != last_code:  # names while they are few
            label = f"{family} {first:02X}h–{last_code:02X}h"
            if last_code - first < 3:
                label += f" ({names})"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator.nvmetcp.conformance.sweep",
                                 description="The generated admin sweep against one target.")
    ap.add_argument("addr", metavar="HOST:PORT")
    ap.add_argument("nqn", metavar="NQN")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    try:
        host, port = parse_addr(args.addr)
    except ValueError as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    results = run_sweep(Target(host, port, args.nqn))
    if args.json:
        print(json.dumps({"schema": "kvtool.sweep/1", "results": to_json(results)}, indent=1))
    else:
        for k, v in results.items():
            print(f"{k}: {text(v)}")
    return 1 if any(v.kind == "error" for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
