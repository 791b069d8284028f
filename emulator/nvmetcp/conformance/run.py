"""Running the cases against one or two targets, the Markdown table, and the command line."""

from __future__ import annotations

import argparse
import json
import struct
import sys

from emulator.nvmetcp.conformance.cases import CASES, Case
from emulator.nvmetcp.conformance.host import Closed, Outcome, ProtocolViolation, Target, closed
from emulator.nvmetcp.conformance.reasons import REASONS


def run_case(t: Target, fn: Case) -> Outcome:
    try:
        return fn(t)
    except Closed as exc:
        return closed(exc)
    except TimeoutError:
        return Outcome("no answer")
    except (ProtocolViolation, OSError, AssertionError, ValueError, struct.error) as exc:
        return Outcome("error", note=f"{type(exc).__name__}: {exc}")


def run_all(t: Target, only: str | None = None) -> dict[str, Outcome]:
    results: dict[str, Outcome] = {}
    for group, name, fn in CASES:
        label = f"{group}: {name}"
        if only and only.lower() not in label.lower():
            continue
        results[label] = run_case(t, fn)
    return results


def markdown(results: dict[str, Outcome], ref: dict[str, Outcome] | None) -> str:
    if ref is None:
        lines = ["| case | result |", "|---|---|"]
        lines += [f"| {k} | {v.text()} |" for k, v in results.items()]
        return "\n".join(lines)
    lines = ["| case | Linux nvmet 6.1 | kvtool | why they differ |", "|---|---|---|---|"]
    for k, v in results.items():
        r = ref.get(k)
        same = r is not None and r.key() == v.key()
        mark = "same" if same else REASONS.get(k, "**differs**")
        lines.append(f"| {k} | {r.text() if r else '-'} | {v.text()} | {mark} |")
    return "\n".join(lines)


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator.nvmetcp.conformance",
                                 description="Differential conformance harness: scripted "
                                 "host behaviours against an NVMe/TCP target.")
    ap.add_argument("addr", metavar="HOST:PORT")
    ap.add_argument("nqn", metavar="NQN")
    ap.add_argument("--against", nargs=2, metavar=("HOST:PORT", "NQN"),
                    help="a reference target (Linux nvmet) to compare with")
    ap.add_argument("--only", help="run the cases whose name contains this text")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = ap.parse_args(argv)
    try:
        host, port = parse_addr(args.addr)
        ref_t = None
        if args.against:
            rh, rp = parse_addr(args.against[0])
            ref_t = Target(rh, rp, args.against[1])
    except ValueError as exc:
        print(f"conformance: {exc}", file=sys.stderr)
        return 2
    results = run_all(Target(host, port, args.nqn), args.only)
    ref = run_all(ref_t, args.only) if ref_t is not None else None
    differs = [k for k, v in results.items() if ref is not None and ref[k].key() != v.key()]
    if args.json:
        doc = {"schema": "kvtool.conformance/1", "cases": [
            {"case": k, "kvtool": v.text(), "kind": v.kind,
             **({"reference": ref[k].text(), "same": k not in differs} if ref else {})}
            for k, v in results.items()]}
        print(json.dumps(doc, indent=2))
    elif args.markdown or ref is not None:
        print(markdown(results, ref))
    else:
        for k, v in results.items():
            print(f"{k}: {v.text()}")
    errors = [k for k, v in results.items() if v.kind == "error"]
    unexplained = [k for k in differs if k not in REASONS]
    return 1 if errors or unexplained else 0

