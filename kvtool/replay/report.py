"""The report of ``kvtool replay`` (schema :data:`~kvtool.replay.settings.SCHEMA`,
docs/json.md): one shape for both modes, times or their absence, and the setup as lines
for people."""

from __future__ import annotations

from typing import Any

from kvtool.units import format_size

DATA_FIELDS: dict[str, Any] = {
    "time_basis": {"load": "modelled", "prefill": "modelled", "decode": "modelled"},
    "verified_blocks": None, "corrupt_blocks": None, "lost_blocks": None,
    "recomputed_blocks": None, "repaired_blocks": None, "problems": [], "measured": None,
    "media": None, "iolog": None,
}
"""Fields only data mode measures: ``null`` in ``--simulate`` so both modes share one shape."""


def simulated(r: dict[str, Any]) -> None:
    """A ``--simulate`` configuration's report: no places, no backends."""
    r["mode"] = "simulate"
    r["requests_served"] = r["requests"]
    for t in r["tiers"]:
        t.update({"backend": "metadata", "url": None, "pool_blocks": None,
                  "failed": None, "committed_objects": None})


def timing_off(result: dict[str, Any], why: str) -> None:
    """A report without times (``--no-times``, or an interrupted run): they are null."""
    for d in [result, *result.get("rounds", [])]:
        for key in ("ttft_p50_s", "ttft_p99_s", "wall_s", "requests_per_s"):
            d[key] = None
    result["time_model"] = {"kind": None, "basis": None, "why_none": why}


def one_shape(result: dict[str, Any]) -> None:
    for key, value in DATA_FIELDS.items():
        result.setdefault(key, value)
    for rnd in result["rounds"]:
        for key in ("verified_blocks", "corrupt_blocks", "lost_blocks", "recomputed_blocks",
                    "repaired_blocks"):
            rnd.setdefault(key, None)


def describe_setup(setup: dict[str, Any]) -> list[str]:
    """The setup as lines for people (printed before the run)."""
    bb = setup.get("block_bytes")
    lines = [f"mode {setup['mode']}"
             + (f" · model {setup['model']} {setup['dtype'] or ''}".rstrip() if setup.get("model")
                else "")
             + f" · {setup['block_tokens']} tokens/block"
             + (f" · {bb:,} B/block" if bb else "")]
    for c in setup.get("configs", []):
        if "tiers" not in c:
            continue
        parts = []
        for name, t in c["tiers"].items():
            if name == "nvme":
                size = "all" if t["capacity"] == "all of it" else t["capacity"]
                parts.append(f"nvme {size} of {t['place']} ({t['why']}), {t['policy']}")
            else:
                parts.append(f"{name} {t['capacity']} ({t['blocks']} blocks), {t['policy']}")
        lines.append("tiers: " + "; ".join(parts) + f" · {c['write_policy']}"
                     + f" · pools {format_size(c['memory_bytes'])}")
    return lines
