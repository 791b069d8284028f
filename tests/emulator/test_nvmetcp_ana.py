"""ANA on kvtool's userspace target: Identify fields, the ANA log page, the ANA Change
notice, I/O refused with a path status on an inaccessible path (and no data written), and
the config's checks. Driven by kvtool's own host over real sockets."""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator

import pytest

from emulator.nvmetcp.config import EmulatorConfig, NamespaceConfig, SubsystemConfig
from emulator.nvmetcp.target import Target
from kvtool.errors import InputError
from kvtool.nvme import pdu as P
from kvtool.nvme import spec
from kvtool.nvme.host import Controller, connect
from kvtool.nvme.queue import Command, NvmeStatusError

NQN = "nqn.2026-01.io.kvtool:ana"


def make_config(ana: dict[str, dict[str, str]] | None = None) -> EmulatorConfig:
    sub = SubsystemConfig(nqn=NQN, allow_any_host=True, namespaces=[
        NamespaceConfig(1, "8MiB"), NamespaceConfig(2, "8MiB", anagrpid=2),
        NamespaceConfig(3, "8MiB", anagrpid=2)])
    return EmulatorConfig(subsystems=[sub], listen=["127.0.0.1:0", "127.0.0.1:0"],
                        ana=ana or {}).validate()


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target(make_config()).start_in_thread()
    # name the listeners by the ports they bound, as kvtool's config does
    t.config.listen = [f"{h}:{p}" for h, p in t.addresses]
    yield t
    t.stop()


def ports(t: Target) -> tuple[int, int]:
    return t.addresses[0][1], t.addresses[1][1]


def states(ctrl: Controller) -> dict[int, tuple[int, tuple[int, ...]]]:
    _chg, groups = ctrl.ana_log()
    return {g.grpid: (g.state, g.nsids) for g in groups}


def test_identify_reports_ana(target: Target) -> None:
    with connect("127.0.0.1", ports(target)[0], NQN) as ctrl:
        info = ctrl.identify_controller()
        assert info.ana and info.cmic & spec.CMIC_MULTI_PORT and info.cmic & spec.CMIC_MULTI_CTRL
        assert info.anacap == spec.ANACAP_ALL and (info.anagrpmax, info.nanagrpid) == (128, 128)
        assert info.anatt > 0 and info.oaes & spec.AEN_CFG_ANA_CHANGE
        assert 0 < info.mnan <= info.nn  # Linux multipath refuses MNAN 0
        # the byte offsets of NVMe 2.0 Figure 275 (Linux's struct nvme_id_ctrl)
        raw = info.raw
        assert (raw[76], raw[342], raw[343]) == (info.cmic, 10, spec.ANACAP_ALL)
        assert struct.unpack_from("<II", raw, 344) == (128, 128)  # ANAGRPMAX, NANAGRPID
        assert struct.unpack_from("<I", raw, 540)[0] == 1024
        assert [ctrl.identify_namespace(n).anagrpid for n in (1, 2, 3)] == [1, 2, 2]
    with connect("127.0.0.1", ports(target)[0], spec.DISCOVERY_NQN) as disc:
        assert not disc.identify_controller().ana  # the discovery controller has no ANA


def test_log_page_per_listener_and_group(target: Target) -> None:
    p1, p2 = ports(target)
    target.set_ana({f"127.0.0.1:{p2}": {"2": "inaccessible"},
                    f"127.0.0.1:{p1}": {"1": "non-optimized"}})
    with connect("127.0.0.1", p1, NQN) as a, connect("127.0.0.1", p2, NQN) as b:
        assert states(a) == {1: (spec.ANA_NON_OPTIMIZED, (1,)), 2: (spec.ANA_OPTIMIZED, (2, 3))}
        assert states(b) == {1: (spec.ANA_OPTIMIZED, (1,)), 2: (spec.ANA_INACCESSIBLE, (2, 3))}
        # RGO (return groups only): the same groups without their NSID lists
        chg, groups = spec.decode_ana_log(b.get_log_page(spec.LID_ANA, 4096, lsp=1))
        assert chg >= 2 and [(g.grpid, g.state, g.nsids) for g in groups] == [
            (1, spec.ANA_OPTIMIZED, ()), (2, spec.ANA_INACCESSIBLE, ())]


def test_io_on_an_inaccessible_path_is_a_path_error_and_writes_nothing(target: Target) -> None:
    p1, p2 = ports(target)
    data = os.urandom(4096)
    with connect("127.0.0.1", p1, NQN) as a, connect("127.0.0.1", p2, NQN) as b:
        a.write(2, 0, data)
        target.set_ana({f"127.0.0.1:{p1}": {"2": "inaccessible"}})
        for call in (lambda: a.read(2, 0, 8), lambda: a.write(2, 0, bytes(4096)),
                     lambda: a.write(3, 8, os.urandom(512))):
            with pytest.raises(NvmeStatusError) as err:
                call()
            e = err.value
            assert (e.sct, e.sc, e.dnr) == (spec.SCT_PATH, spec.SC_ANA_INACCESSIBLE, False)
        a.write(1, 0, data)  # group 1 is still optimized on this path
        assert b.read(2, 0, 8) == data  # the refused write (in-capsule) did not land
        assert b.read(3, 8, 1) == bytes(512)
        target.set_ana({f"127.0.0.1:{p1}": {"2": "change"}})
        with pytest.raises(NvmeStatusError) as err:
            a.read(2, 0, 8)
        assert (err.value.sct, err.value.sc) == (spec.SCT_PATH, spec.SC_ANA_TRANSITION)
        target.set_ana({})
        assert a.read(2, 0, 8) == data


def test_ana_change_notice_once_until_the_log_is_read(target: Target) -> None:
    p1, p2 = ports(target)
    with connect("127.0.0.1", p1, NQN) as a, connect("127.0.0.1", p2, NQN) as b:
        events: list[int] = []
        got = threading.Event()

        def on_event(cmd: Command) -> None:
            events.append(cmd.result().dw0)
            got.set()

        for ctrl in (a, b):
            assert ctrl.set_features(spec.FID_ASYNC_EVENT_CONFIG, spec.AEN_CFG_ANA_CHANGE) == 0
        a.submit_admin(P.Sqe(spec.ADMIN_ASYNC_EVENT), "AER", on_event)
        other: list[int] = []
        b.submit_admin(P.Sqe(spec.ADMIN_ASYNC_EVENT), "AER", lambda c: other.append(c.cqe.dw0
                                                                                   if c.cqe else -1))
        target.set_ana({f"127.0.0.1:{p1}": {"1": "inaccessible"}})
        assert got.wait(5)
        assert events == [(spec.LID_ANA << 16) | (spec.AER_NOTICE_ANA_CHANGE << 8)
                          | spec.AER_TYPE_NOTICE]
        assert other == []  # nothing changed on b's listener
        # masked until the log is read: a second change raises no second notice
        got.clear()
        a.submit_admin(P.Sqe(spec.ADMIN_ASYNC_EVENT), "AER", on_event)
        target.set_ana({f"127.0.0.1:{p1}": {"1": "non-optimized"}})
        assert not got.wait(0.5)
        assert states(a)[1][0] == spec.ANA_NON_OPTIMIZED  # reading it re-arms the notice
        target.set_ana({})
        assert got.wait(5) and len(events) == 2


def test_config_checks_name_the_field() -> None:
    with pytest.raises(InputError, match="not one of the listen addresses") as err:
        make_config({"127.0.0.1:9": {"1": "inaccessible"}})
    assert err.value.field == "ana.127.0.0.1:9"
    with pytest.raises(InputError, match="ANA group must be"):
        make_config({"127.0.0.1:0": {"0": "inaccessible"}})
    with pytest.raises(InputError, match="unknown ANA state"):
        make_config({"127.0.0.1:0": {"1": "sideways"}})
    with pytest.raises(InputError) as err:
        EmulatorConfig.from_dict({"subsystems": [{"nqn": NQN, "allow_any_host": True,
                                                "namespaces": [{"nsid": 1, "backing": "1MiB",
                                                                "anagrpid": 200}]}]})
    assert err.value.field == "subsystems[0].namespaces[0].anagrpid"


def test_ana_log_codec_round_trip() -> None:
    groups = [spec.AnaGroup(1, spec.ANA_OPTIMIZED, (1, 4), 7),
              spec.AnaGroup(9, spec.ANA_INACCESSIBLE, (), 7)]
    raw = spec.encode_ana_log(7, groups)
    assert len(raw) == 16 + 32 * 2 + 8
    assert spec.decode_ana_log(raw + bytes(100)) == (7, groups)
    with pytest.raises(ValueError, match="cut short"):
        spec.decode_ana_log(raw[:40])
