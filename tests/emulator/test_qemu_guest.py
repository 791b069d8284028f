"""emulator.qemu: the guest image builder's parts, the relay, and real guests (smoke tests)."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulator.qemu import build, cpio, measure, moddeps, probe, vmlinux
from emulator.qemu.guest import GUESTFWD_ADDR, RELAY, Guest, GuestDied, GuestError
from kvtool.nvme.host import ConnectError, connect
from kvtool.nvme.url import default_hostnqn
from tests.helpers.qemu_guest import GUEST_HOSTNQN, KernelTarget, MakeGuest

# --- builder parts (no QEMU) ------------------------------------------------------------------


def _read_newc(blob: bytes) -> dict[str, tuple[int, bytes]]:
    """Independent newc reader: name -> (mode, data)."""
    entries: dict[str, tuple[int, bytes]] = {}
    off = 0
    while True:
        assert blob[off:off + 6] == b"070701"
        fields = [int(blob[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name_start = off + 110
        name = blob[name_start:name_start + namesize - 1].decode()
        data_start = name_start + namesize + (-(110 + namesize) % 4)
        data = blob[data_start:data_start + size]
        off = data_start + size + (-size % 4)
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, data)


def test_cpio_newc_archives_files_dirs_and_symlinks(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "busybox").write_bytes(b"\x7fELF" + bytes(range(256)) * 3)
    (tmp_path / "init").write_text("#!/bin/busybox sh\n")
    (tmp_path / "init").chmod(0o755)
    (tmp_path / "bin" / "sh").symlink_to("busybox")
    out = tmp_path.parent / "out.cpio"
    with out.open("wb") as fh:
        cpio.write_newc(tmp_path, fh)
    entries = _read_newc(out.read_bytes())
    assert set(entries) == {"bin", "bin/busybox", "bin/sh", "init"}
    assert entries["bin/busybox"][1] == (tmp_path / "bin" / "busybox").read_bytes()
    assert entries["bin/sh"] == (0o120777, b"busybox")
    assert entries["init"][0] & 0o777 == 0o755
    assert entries["bin"][0] & 0o170000 == 0o040000
    assert len(out.read_bytes()) % 4 == 0


def _fake_ko(path: Path, depends: str = "", softdep: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    info = b"\x00license=GPL\x00depends=" + depends.encode() + b"\x00"
    if softdep:
        info += b"softdep=pre: " + softdep.encode() + b"\x00"
    path.write_bytes(b"\x7fELF" + info + b"\x00vermagic=6.1\x00")


def test_moddeps_orders_dependencies_first_and_takes_shipped_softdeps(tmp_path: Path) -> None:
    k = tmp_path / "kernel"
    _fake_ko(k / "drivers/nvme/target/nvmet-tcp.ko", "nvmet")
    _fake_ko(k / "drivers/nvme/target/nvmet.ko", "configfs,nvme-core")
    _fake_ko(k / "drivers/nvme/host/nvme-core.ko", "", softdep="crc32c_generic absent_mod")
    _fake_ko(k / "crypto/crc32c_generic.ko")
    (tmp_path / "modules.builtin").write_text("kernel/fs/configfs/configfs.ko\n")
    order = moddeps.resolve(tmp_path, ["nvmet_tcp"])
    assert order == [
        "kernel/crypto/crc32c_generic.ko",
        "kernel/drivers/nvme/host/nvme-core.ko",
        "kernel/drivers/nvme/target/nvmet.ko",
        "kernel/drivers/nvme/target/nvmet-tcp.ko",
    ]


def test_moddeps_names_a_missing_hard_dependency(tmp_path: Path) -> None:
    _fake_ko(tmp_path / "kernel/a.ko", "b")
    with pytest.raises(moddeps.ModuleNotFound, match=r"not found.*: b"):
        moddeps.resolve(tmp_path, ["a"])


def test_vmlinux_extract_skips_false_magic_and_finds_the_elf() -> None:
    elf = b"\x7fELF\x02\x01\x01" + os.urandom(5000)
    blob = b"MZ setup" + b"\xfd7zXZ\x00garbage" + bytes(100) + lzma.compress(elf) + b"trailer"
    assert vmlinux.extract_elf(blob) == elf
    with pytest.raises(ValueError, match="no XZ"):
        vmlinux.extract_elf(b"MZ" + lzma.compress(b"not an elf"))


def test_build_without_root_names_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (without root it cannot be)")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(build.BuildError, match="needs root"):
        build.ensure_built(tmp_path / "cache")


def test_cached_build_is_reused_without_apt(
    guest_image: build.GuestImage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once built, the image is returned offline: no apt, no root."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(Path(shutil.which("qemu-system-x86_64") or "/").parent))
    again = build.ensure_built(guest_image.workdir, kernel=guest_image.series)
    assert again == guest_image
    assert again.kernel.read_bytes()[:4] == b"\x7fELF"


def test_guest_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="NQN"):
        Guest(nqn="nqn.with space")
    with pytest.raises(ValueError, match="NQN"):
        Guest(allowed_hosts=["a,b"])
    with pytest.raises(ValueError, match="backing"):
        Guest(backing="nvme")


@pytest.mark.parametrize("argv", [["run", "--port", "99999"], ["run", "--port", "-1"],
                                  ["run", "--forward", "0:5"], ["run", "--forward", "22:70000"],
                                  ["run", "--guest-forward", "0"], ["run", "--mem-mb", "0"],
                                  ["exec", "0", "true"]])
def test_command_line_rejects_bad_numbers_before_booting(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from emulator.qemu.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_icreq_golden_bytes() -> None:
    pdu = probe.build_icreq(digest=3)
    assert len(pdu) == 128
    assert pdu[:8] == bytes([0x00, 0x00, 128, 0x00]) + struct.pack("<I", 128)
    assert pdu[8:16] == struct.pack("<HBBI", 0, 0, 3, 0)
    assert pdu[16:] == bytes(112)


# --- the guest-to-host relay, over real sockets -------------------------------------------------


@pytest.fixture
def echo_server() -> Iterator[int]:
    """127.0.0.1 server: reads until EOF, answers 'echo:' + sha256 + the bytes, closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(1 << 16):
                    data += chunk
                conn.sendall(b"echo:" + hashlib.sha256(data).hexdigest().encode() + data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    srv.close()


def test_relay_copies_both_ways_with_half_close(echo_server: int) -> None:
    guest_side, relay_side = socket.socketpair()
    payload = os.urandom(3 << 20)
    fd = relay_side.fileno()
    proc = subprocess.Popen([sys.executable, "-I", str(RELAY), str(echo_server)],
                            stdin=fd, stdout=fd, stderr=fd)
    relay_side.close()

    def write() -> None:
        guest_side.sendall(payload)
        guest_side.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write)
    writer.start()
    got = b""
    while chunk := guest_side.recv(1 << 16):
        got += chunk
    writer.join()
    assert proc.wait(timeout=10) == 0
    assert got == b"echo:" + hashlib.sha256(payload).hexdigest().encode() + payload


def test_relay_exits_nonzero_when_nothing_listens() -> None:
    guest_side, relay_side = socket.socketpair()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    fd = relay_side.fileno()
    proc = subprocess.run([sys.executable, "-I", str(RELAY), str(closed_port)],
                          stdin=fd, stdout=fd, stderr=fd, timeout=20)
    relay_side.close()
    assert proc.returncode == 1
    guest_side.settimeout(5)
    assert guest_side.recv(10) == b""  # nothing (no traceback) leaked into the stream


# --- real guests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_target_options() -> dict[str, Any]:
    """This module's target lists its hosts: kvtool's default host NQN and the guest's own."""
    return {"allowed_hosts": [default_hostnqn(), GUEST_HOSTNQN]}


def test_kernel_target_boots_answers_icreq_runs_commands_and_stops(
    kernel_target: KernelTarget,
) -> None:
    guest = kernel_target.guest
    icresp = probe.probe(kernel_target.host, kernel_target.port)
    # the Linux target's ICResp (NVMe/TCP transport spec, ICResp PDU): PFV 0, CPDA 0, MAXH2CDATA 4 MiB
    assert (icresp.pfv, icresp.cpda, icresp.maxh2cdata) == (0, 0, 4 << 20)
    assert probe.probe(kernel_target.host, kernel_target.port, digest=3).dgst == 3

    rc, out = guest.exec("uname -r; cat /sys/kernel/config/nvmet/ports/1/addr_trsvcid;"
                         " ls /sys/kernel/config/nvmet/subsystems; blockdev --getsize64 /dev/ram0")
    assert rc == 0
    kver, trsvcid, nqn, size = out.split()
    assert guest.image is not None and kver == guest.image.kernel_version
    assert (trsvcid, nqn, int(size)) == ("4420", kernel_target.subnqn, kernel_target.size)
    assert guest.exec("exit 7")[0] == 7
    subsys = f"/sys/kernel/config/nvmet/subsystems/{kernel_target.subnqn}"
    assert guest.check(f"cat {subsys}/attr_allow_any_host; ls {subsys}/allowed_hosts").split() \
        == ["0", *sorted([default_hostnqn(), GUEST_HOSTNQN])]
    with pytest.raises(ConnectError, match="not allowed"):
        connect(kernel_target.host, kernel_target.port, kernel_target.subnqn,
                hostnqn="nqn.2026-01.io.kvtool:host:unlisted")
    with pytest.raises(TimeoutError):
        guest.exec("sleep 5", timeout=1)
    assert "KVTOOL-TARGET-READY" in guest.console_log
    assert guest.boot_seconds is not None and guest.boot_seconds > 0


def test_measure_runs_every_case_on_a_running_guest(kernel_target: KernelTarget) -> None:
    """The reference-figure script (emulator.qemu.measure) works end to end; no timing asserts."""
    result = measure.measure(2, (1,), guest=kernel_target.guest)
    cases = {(r["path"].split(" ->")[0], r["op"], r["digests"]) for r in result["rows"]}
    assert len(cases) == len(result["rows"]) == 6
    assert all(r["mb_per_s"] > 0 for r in result["rows"])
    assert result["raw_stream_host_to_guest_mb_per_s"] > 0
    assert result["raw_stream_guest_to_host_mb_per_s"] > 0


def test_command_line_build_and_exec(kernel_target: KernelTarget) -> None:
    assert kernel_target.guest.image is not None
    built = subprocess.run([sys.executable, "-m", "emulator.qemu", "build", "--kernel",
                            kernel_target.guest.image.series], capture_output=True,
                           text=True, timeout=600, check=True)
    record = json.loads(built.stdout)
    assert kernel_target.guest.image is not None
    assert record["kernel"] == str(kernel_target.guest.image.kernel)
    assert Path(record["initrd"]).stat().st_size > 1 << 20
    ran = subprocess.run([sys.executable, "-m", "emulator.qemu", "exec",
                          str(kernel_target.guest.control_port), "echo guest says hi; exit 3"],
                         capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (3, "guest says hi\n")
    bad = subprocess.run([sys.executable, "-m", "emulator.qemu", "run", "--forward", "x:y"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "GUEST_PORT[:HOST_PORT]" in bad.stderr


def test_guest_without_target_hostroot_and_isolated_guestfwd(
    make_guest: MakeGuest, echo_server: int
) -> None:
    guest = make_guest(target=False, hostroot=True, guest_forwards=[echo_server])
    out = guest.check("ls /sys/kernel/config/nvmet/subsystems /sys/kernel/config/nvmet/ports"
                      " | wc -w; ls /sys/module | grep -c -e '^nvmet_tcp$' -e '^nvme_tcp$'")
    assert out.split() == ["2", "2"]  # the two directory headers only: nothing configured
    rc, out = guest.exec(f"echo -n hello | nc -w 5 {GUESTFWD_ADDR} {echo_server}")
    assert (rc, out) == (0, "echo:" + hashlib.sha256(b"hello").hexdigest() + "hello")
    # restrict=on: slirp's host alias and the outside world are unreachable
    rc, out = guest.exec(f"echo x | nc -w 3 10.0.2.2 {echo_server}")
    assert rc != 0, out
    # the host's own Python (this virtualenv) runs in the guest, chrooted into the host root
    out = guest.check(f"chroot /hostroot {sys.executable} -c 'import sys; print(sys.prefix)'",
                      timeout=120)
    assert out.strip().splitlines()[-1] == sys.prefix
    rc, out = guest.exec("touch /hostroot/etc/kvtool-overlay-test && ls /etc/kvtool-overlay-test")
    assert not Path("/etc/kvtool-overlay-test").exists()  # writes stay in the guest's overlay

    pid = guest.pid
    guest.stop()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    with pytest.raises(GuestError):
        guest.wait_ready()
    assert "KVTOOL-GUEST-READY" in guest.console_log


def test_a_command_to_a_guest_whose_qemu_died_says_how_it_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest whose QEMU was killed refuses its control port: ``exec`` says QEMU's exit
    status (-9: SIGKILL, the OOM killer's) and the console's last lines, and is still the
    ConnectionError callers wait on. No QEMU needed: a shell stands in for it."""
    import emulator.qemu.guest as guest_module

    monkeypatch.setattr(guest_module, "ensure_qemu", lambda: None)
    monkeypatch.setattr(guest_module, "ensure_built", lambda: None)
    guest = Guest()
    monkeypatch.setattr(guest, "qemu_argv", lambda: ["sh", "-c", "sleep 60"])
    guest.start(wait=False)
    try:
        with pytest.raises(ConnectionError) as alive:  # QEMU up, nobody at the port
            guest.exec("true", timeout=5)
        assert not isinstance(alive.value, GuestDied)
        assert guest.console_path is not None and guest.pid is not None
        guest.console_path.write_text("boot\nkvtool-init: serving\nOut of memory\n")
        os.kill(guest.pid, 9)
        while guest.running:
            time.sleep(0.01)
        with pytest.raises(GuestDied) as err:
            guest.exec("kvtool load --count 64", timeout=5)
    finally:
        guest.stop()
    assert isinstance(err.value, ConnectionError) and isinstance(err.value, GuestError)
    text = str(err.value)
    assert "qemu exited with status -9 (killed: SIGKILL" in text
    assert "kvtool load --count 64" in text and "Out of memory" in text
