"""nvme+tcp:// URLs, the default host NQN and the host ID."""

from __future__ import annotations

import uuid

import pytest

from kvtool.errors import UsageError
from kvtool.nvme.url import NvmeUrl, default_hostnqn, hostid_for, parse_nvme_url

SUB = "nqn.2026-01.io.kvtool:kv0"


@pytest.mark.parametrize(("url", "want"), [
    (f"nvme+tcp://127.0.0.1:4420/{SUB}", NvmeUrl("127.0.0.1", 4420, SUB)),
    (f"nvme+tcp://127.0.0.1/{SUB}/2", NvmeUrl("127.0.0.1", 4420, SUB, 2)),
    (f"nvme+tcp://[::1]:4421/{SUB}/7", NvmeUrl("::1", 4421, SUB, 7)),
    (f"nvme+tcp://h:9/{SUB}?hostnqn=nqn.2026-01.io.kvtool:me",
     NvmeUrl("h", 9, SUB, None, "nqn.2026-01.io.kvtool:me")),
])
def test_parse(url: str, want: NvmeUrl) -> None:
    assert parse_nvme_url(url) == want


def test_str_round_trips() -> None:
    for text in (f"nvme+tcp://127.0.0.1:4420/{SUB}/1", f"nvme+tcp://[::1]:4420/{SUB}"):
        assert str(parse_nvme_url(text)) == text


@pytest.mark.parametrize(("url", "message"), [
    (f"nvme://127.0.0.1/{SUB}", "not an NVMe/TCP URL"),
    ("nvme+tcp://127.0.0.1:4420", "subsystem NQN is missing"),
    ("nvme+tcp://127.0.0.1:4420/", "subsystem NQN is missing"),
    (f"nvme+tcp://127.0.0.1:99999/{SUB}", "not a TCP port"),
    (f"nvme+tcp://127.0.0.1:x/{SUB}", "not a TCP port"),
    (f"nvme+tcp://:4420/{SUB}", "host is missing"),
    (f"nvme+tcp://127.0.0.1/{SUB}/0", "not a namespace ID"),
    (f"nvme+tcp://127.0.0.1/{SUB}/abc", "not a namespace ID"),
    ("nvme+tcp://127.0.0.1/iqn.2001-04.com.example:x", "not an NQN"),
    (f"nvme+tcp://127.0.0.1/{SUB}?foo=1", "unknown parameter"),
    (f"nvme+tcp://127.0.0.1/{SUB}?hostnqn=bad", "not an NQN"),
    (f"nvme+tcp://[::1/{SUB}", "bad IPv6"),
])
def test_bad_urls_name_the_field(url: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse_nvme_url(url)
    assert info.value.field == "TARGET"


def test_default_hostnqn_is_stable_and_overridable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTOOL_HOSTNQN", raising=False)
    first = default_hostnqn()
    assert first.startswith("nqn.") and first == default_hostnqn()
    monkeypatch.setenv("KVTOOL_HOSTNQN", "nqn.2026-01.io.kvtool:env-host")
    assert default_hostnqn() == "nqn.2026-01.io.kvtool:env-host"
    monkeypatch.setenv("KVTOOL_HOSTNQN", "nope")
    with pytest.raises(UsageError):
        default_hostnqn()


def test_hostid() -> None:
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert hostid_for(f"nqn.2014-08.org.nvmexpress:uuid:{u}") == u.bytes
    a = hostid_for("nqn.2026-01.io.kvtool:a")
    assert len(a) == 16 and a == hostid_for("nqn.2026-01.io.kvtool:a")
    assert a != hostid_for("nqn.2026-01.io.kvtool:b")
