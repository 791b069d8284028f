"""Why kvtool's target answers a case differently from Linux nvmet 6.1, case label -> reason.
Every case whose outcome differs must be here, and nothing else (the conformance test
checks both directions)."""

from __future__ import annotations

REASONS: dict[str, str] = {
    "SGL: Identify with a Keyed Data Block SGL (RDMA's form)":
        "spec: TCP has no keyed SGLs (SGL Descriptor Type Invalid); Linux treats any "
        "descriptor as transport data, SPDK ends the connection",
    "Identify: CNS 00h namespace 1":
        "DLFEAT: deallocated blocks do read as zeros here, so it says so; Linux leaves 0",
    "Identify: CNS 02h from NSID FFFFFFFEh":
        "spec and SPDK: Invalid Namespace or Format for NSID ≥ FFFFFFFEh",
    "Log page: SMART / Health: Data Units Written after 1000+1 blocks":
        "Linux copies block-layer statistics, and the guest's brd device keeps none (file "
        "namespaces report zeros too); kvtool counts every Read and Write",
    "Log page: SMART / Health with a dword-aligned offset (LPO 4)":
        "spec: LPA bit 2, which Linux advertises too, allows an offset and a partial page; "
        "Linux 6.1 answers any SMART read that is not exactly 512 bytes with Internal Error",
    "Log page: Firmware Slot Information":
        "spec and SPDK: AFI names the active slot (1); Linux returns an all-zero page",
    "Log page: Discovery log (70h) on a data NQN":
        "spec and SPDK: Invalid Log Page (SCT 1); Linux: Invalid Field",
    "Log page: unknown LID C0h":
        "spec and SPDK: Invalid Log Page (SCT 1); Linux: Invalid Field",
    "I/O: Write 8 KiB with a Transport SGL (fits the in-capsule size)":
        "Linux waits for in-capsule data whenever a write fits its inline size, whatever "
        "the SGL says, and the command hangs; kvtool sends the R2T the SGL asks for",
    "I/O: Read past the end (last LBA + 1 block)":
        "spec: LBA Out of Range; Linux passes the block layer's EIO on as Internal Error",
    "I/O: Write past the end": "as above",
    "I/O: Write Zeroes past the end": "as above",
    "Transport: wrong data digest on an in-capsule write":
        "spec and SPDK: a data digest error fails the command (Transient Transport Error); "
        "Linux drops the connection",
}



# The sweep (docs/nvme-tcp.md, "The sweep"): probe label -> why kvtool answers differently
# from at least one of Linux nvmet 6.1, Linux nvmet 6.12 and SPDK (a difference in the DNR
# bit alone is not one: sweep.DNR_ONLY). Exactly the probes where it does
# (tests/emulator/test_sweep.py checks both directions).
_MANDATORY_GET = ("spec: mandatory for an I/O controller (NVMe 1.4, Feature Identifiers); "
                  "SPDK answers 0, as kvtool; Linux has no handler")
_MANDATORY_SET = "spec: mandatory; SPDK accepts it, as kvtool; Linux has no handler"
_LENGTH_FIRST = ("spec and SPDK: an unsupported FID is Invalid Field whatever the data "
                 "length; Linux checks the length first")
_V2_ONLY = ("an NVMe 2.0 structure: SPDK reports VS 2.0 and answers it; kvtool reports "
            "VS 1.3, as Linux, where it is reserved")
_NO_RESERVATIONS = ("reservations are optional: kvtool, as Linux, offers none (ONCS bit 5 "
                    "clear); SPDK does")
_INVALID_LOG_PAGE = "spec and SPDK: Invalid Log Page (SCT 1); Linux: Invalid Field"
_UNKNOWN_LIDS = (0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B, *range(0x0D, 0x12), *range(0x14, 0x20),
                 0x70, 0x81, 0xC0, 0xC2, 0xCA)
_LOG_NAMES = {
    0x06: "Device Self-test", 0x07: "Telemetry Host-Initiated",
    0x08: "Telemetry Controller-Initiated", 0x09: "Endurance Group Information",
    0x0A: "Predictable Latency Per NVM Set", 0x0B: "Predictable Latency Event Aggregate",
    0x0D: "Persistent Event", 0x0E: "LBA Status", 0x0F: "Endurance Group Event Aggregate",
    0x10: "Media Unit Status", 0x11: "Supported Capacity Configuration List",
    0x14: "Command and Feature Lockdown", 0x15: "Boot Partition", 0x16: "Rotational Media",
    0x17: "Dispersed Namespace Participating NVM Subsystems", 0x18: "Management Address "
    "List", 0x19: "Physical Interface Receiver Eye Opening", 0x1A: "Reachability Groups",
    0x1B: "Reachability Associations", 0x1C: "Changed Allocated Namespace List",
    0x1D: "FDP Configurations", 0x1E: "Reclaim Unit Handle Usage", 0x1F: "FDP Statistics",
    0x70: "Discovery", 0x81: "Sanitize Status", 0xC0: "vendor C0h (OCP SMART)",
    0xC2: "vendor C2h (Intel temperature)", 0xCA: "vendor CAh (Intel SMART)",
}

SWEEP_REASONS: dict[str, str] = {
    "Get Features 01h Arbitration": _MANDATORY_GET,
    "Get Features 02h Power Management": _MANDATORY_GET,
    "Get Features 04h Temperature Threshold": _MANDATORY_GET + " (no sensor: every threshold "
    "reads 0)",
    "Get Features 05h Error Recovery": _MANDATORY_GET,
    "Get Features 0Ah Write Atomicity Normal": _MANDATORY_GET,
    "Get Features 03h LBA Range Type": _LENGTH_FIRST,
    "Get Features 0Ch Autonomous Power State Transition": _LENGTH_FIRST,
    "Get Features 0Dh Host Memory Buffer": _LENGTH_FIRST,
    "Get Features 0Eh Timestamp": _LENGTH_FIRST,
    "Get Features 13h Predictable Latency Mode Config": _LENGTH_FIRST,
    "Get Features 16h Host Behavior Support":
        "optional: kvtool, as Linux, does not offer it (SPDK does); " + _LENGTH_FIRST,
    "Get Features 08h Interrupt Coalescing":
        "spec: interrupt features belong to PCIe controllers; Linux refuses them, SPDK "
        "answers its defaults",
    "Get Features 09h Interrupt Vector Configuration": "as above",
    "Get Features 0Bh Asynchronous Event Configuration":
        "kvtool always reports ANA (OAES bit 11) and enables both notices, as Linux; SPDK "
        "enables ANA Change only on a subsystem with ANA reporting",
    "Get Features 82h Reservation Notification Mask": _NO_RESERVATIONS,
    "Get Features 83h Reservation Persistence": _NO_RESERVATIONS,
    "Get Features 84h Namespace Write Protection Config":
        "optional, and offered only with Identify Controller NWPC set: Linux sets it, "
        "kvtool (as SPDK) does not",
    "Identify CNS 05h I/O Command Set specific Namespace": _V2_ONLY,
    "Identify CNS 06h I/O Command Set specific Controller":
        "SPDK states NVM command set limits; kvtool, as Linux, has none (all zeros)",
    "Identify CNS 07h Active Namespace ID list (I/O Command Set)": _V2_ONLY,
    "Identify CNS 08h I/O Command Set Independent Namespace": _V2_ONLY,
    "Log page 00h Supported Log Pages": _V2_ONLY + "; " + _INVALID_LOG_PAGE,
    "Log page 01h Error Information":
        "kvtool records each failed command, as Linux; SPDK keeps no entries",
    "Log page 02h SMART / Health":
        "kvtool counts commands, data units and errors (Linux some of them); SPDK's page "
        "is all zeros",
    "Log page 03h Firmware Slot":
        "spec and SPDK: AFI names the active slot (1); Linux returns an all-zero page",
    "Log page 0Ch Asymmetric Namespace Access":
        "kvtool always reports ANA, as Linux; SPDK only on a subsystem with ANA reporting",
    "Log page 12h Feature Identifiers Supported and Effects":
        _V2_ONLY + "; " + _INVALID_LOG_PAGE,
    "Log page 13h NVMe-MI Commands Supported and Effects":
        _V2_ONLY + "; " + _INVALID_LOG_PAGE,
    "Log page 80h Reservation Notification": _NO_RESERVATIONS + "; " + _INVALID_LOG_PAGE,
    **{f"Log page {lid:02X}h {_LOG_NAMES[lid]}": _INVALID_LOG_PAGE for lid in _UNKNOWN_LIDS},
    "Set Features 01h Arbitration": _MANDATORY_SET,
    "Set Features 02h Power Management": _MANDATORY_SET + " (power state 0 only)",
    "Set Features 04h Temperature Threshold": _MANDATORY_SET,
    "Set Features 05h Error Recovery": _MANDATORY_SET,
    "Set Features 06h Volatile Write Cache":
        "spec: mandatory when VWC is 1 (all three report 1); SPDK accepts it, Linux has no "
        "handler; kvtool accepts WCE 1 and answers WCE 0 with Feature Not Changeable (its "
        "cache cannot be switched off)",
    "Set Features 0Ah Write Atomicity Normal": _MANDATORY_SET,
}
