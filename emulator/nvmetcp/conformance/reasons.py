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
# from at least one of Linux nvmet 6.1, Linux nvmet 6.12 and SPDK. Exactly the probes where
# it does (tests/emulator/test_sweep.py checks both directions).
SWEEP_REASONS: dict[str, str] = {
}
