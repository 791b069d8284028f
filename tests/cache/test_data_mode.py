"""Data mode: real bytes through the tiers; it must agree with --simulate exactly, check
every block it loads, and survive corruption, a dead target and Ctrl-C."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulator.nvmetcp import EmulatorConfig, NamespaceConfig, SubsystemConfig, Target
from kvtool.replay.data import TierFailed
from kvtool.replay.run import ReplaySettings, prepare
from kvtool.tiers.option import TierOption
from tests.conftest import FIXTURES, run

MULTI = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")
TOKENS = str(FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl")
NQN = "nqn.2026-01.io.kvtool:data-mode"
COMPARED = ("hit_tokens", "recompute_tokens", "put_blocks", "promoted_blocks", "evictions",
            "blocks_written", "token_hit_ratio", "requests")


def settings(trace: str, tiers: dict[str, str], **kw: Any) -> ReplaySettings:
    return ReplaySettings(trace, tiers={k: TierOption.parse(v, tier=k) for k, v in tiers.items()},
                          **kw)


def same(data: dict[str, Any], sim: dict[str, Any]) -> None:
    assert data["mode"] == "data" and sim["mode"] == "simulate"
    for key in COMPARED:
        assert data[key] == sim[key], key
    assert len(data["rounds"]) == len(sim["rounds"])
    for rd, rs in zip(data["rounds"], sim["rounds"], strict=True):
        for key in COMPARED:
            assert rd[key] == rs[key], (rd["round"], key)
    assert data["corrupt_blocks"] == data["lost_blocks"] == 0
    loaded = sum(v for k, v in data["hit_tokens"].items() if k not in ("gpu", "total"))
    assert (data["verified_blocks"] > 0) == (loaded > 0)


@pytest.mark.parametrize(("trace", "tiers", "extra"), [
    (MULTI, {"gpu": "20blk", "dram": "60blk", "nvme": "600blk"}, {"policy": "lru"}),
    (MULTI, {"gpu": "40blk", "dram": "100blk", "nvme": "300blk"},
     {"policy": "lru-tail-first", "write_policy": "write-back"}),
    (MULTI, {"dram": "120blk", "nvme": "200blk"}, {"policy": "radix"}),
    (MULTI, {"gpu": "30blk", "dram": "90blk", "nvme": "250blk"},
     {"policy": "mooncake", "watermark": 0.9, "evict_ratio": 0.1}),
    (TOKENS, {"gpu": "4blk", "dram": "8blk", "nvme": "40blk"}, {"policy": "lru"}),
])
def test_data_equals_simulate(store_dir: Path, trace: str, tiers: dict[str, str],
                              extra: dict[str, Any]) -> None:
    sim = prepare(settings(trace, tiers, simulate=True, block_bytes=4096, **extra)).run()
    placed = {**tiers, "nvme": f"{tiers['nvme']}@{store_dir / 'nvme.img'}"}
    data = prepare(settings(trace, placed, block_bytes=4096, read_qd=4, **extra)).run()
    same(data, sim)
    assert data["tiers"][-1]["backend"] == "objectstore"
    assert data["tiers"][-1]["url"] == str(store_dir / "nvme.img")


def test_data_equals_simulate_on_a_mooncake_slice(store_dir: Path, mooncake_traces: Path,
                                                  tmp_path: Path) -> None:
    lines = (mooncake_traces / "conversation_trace.jsonl").read_text().splitlines()[:400]
    trace = tmp_path / "slice.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    tiers = {"gpu": "20blk", "dram": "2000blk", "nvme": "12000blk"}
    sim = prepare(settings(str(trace), tiers, simulate=True, block_bytes=2048)).run()
    placed = {**tiers, "nvme": f"12000blk@{store_dir / 'mc.img'}"}
    data = prepare(settings(str(trace), placed, block_bytes=2048)).run()
    same(data, sim)
    assert all(data["hit_tokens"][t] > 0 for t in ("gpu", "dram", "nvme"))


def test_deepseek_blocks_through_the_bounce_path(store_dir: Path) -> None:
    """Blocks of the real DeepSeek-V4-Flash FP8 size (1,002,240 B ≡ 256 mod 512)."""
    tiers = {"gpu": "24blk", "dram": "48blk", "nvme": f"300blk@{store_dir / 'ds.img'}"}
    data = prepare(settings(MULTI, tiers, model="deepseek-v4-flash", dtype="fp8")).run()
    assert data["block_bytes"] == 1_002_240
    links = data["measured"]["links"]
    assert {"gpu<-dram", "gpu<-nvme", "dram<-gpu", "nvme<-gpu"} <= set(links)
    assert links["nvme<-gpu"]["bytes"] == data["put_bytes"]["nvme"] + data["promoted_bytes"]["nvme"]
    assert links["gpu<-nvme"]["blocks"] == data["blocks_read"]["nvme"] > 0
    assert links["gpu<-dram"]["blocks"] == data["blocks_read"]["dram"] > 0
    assert data["verified_blocks"] == sum(lk["blocks"] for n, lk in links.items()
                                          if n.startswith("gpu<-"))


def _corrupt_every_slot(tier: Any) -> int:
    """Flip a byte in the middle of every object the NVMe tier holds (behind its back)."""
    fd = os.open(tier.url, os.O_RDWR)
    try:
        for slot in tier.slot_of.values():
            off = tier.sb.slot_offset(slot) + tier.block_bytes // 2
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(tier.slot_of)


def _engine(job: Any) -> Any:
    from kvtool.replay.data import DataReplayer
    from kvtool.replay.run import open_tiers

    cfg = job.configs[0]
    tiers, _media, cfg = open_tiers(cfg, job.block_bytes, job.work_blocks, job.settings,
                                    job.setup, job.create)
    return DataReplayer(cfg, job.block_tokens, job.block_bytes, tiers=tiers,
                      work_blocks=job.work_blocks, on_tier_error=job.settings.on_tier_error)


def test_corrupt_objects_are_detected_counted_and_recomputed(store_dir: Path) -> None:
    tiers = {"gpu": "20blk", "dram": "40blk", "nvme": f"600blk@{store_dir / 'c.img'}"}
    job = prepare(settings(MULTI, tiers, block_bytes=8192, policy="lru"))
    eng = _engine(job)
    try:
        reqs = list(job.reader)
        for req in reqs[:48]:
            eng.feed(req)
        assert eng.data_totals().corrupt_blocks == 0
        flipped = _corrupt_every_slot(eng.data_tiers["nvme"])
        assert flipped > 0
        for req in reqs[48:]:
            eng.feed(req)
        res = eng.result()
    finally:
        eng.close()
    sim = prepare(settings(MULTI, {k: v.split("@")[0] for k, v in tiers.items()},
                           simulate=True, block_bytes=8192, policy="lru")).run()
    assert res["corrupt_blocks"] > 0
    # nothing below NVMe: every corrupt block was recomputed, and its stale copy rewritten
    assert res["recomputed_blocks"] == res["corrupt_blocks"]
    assert res["repaired_blocks"] == res["corrupt_blocks"]
    assert res["hit_tokens"]["nvme"] < sim["hit_tokens"]["nvme"]
    assert res["recompute_tokens"] > sim["recompute_tokens"]
    assert res["hit_tokens"]["total"] + res["recompute_tokens"] == res["input_tokens"]
    named = res["problems"]
    assert named and all(p["kind"] == "corrupt" and p["tier"] == "nvme" for p in named)
    assert all(p["round"] >= 7 for p in named)


@pytest.fixture
def live_target() -> Iterator[Target]:
    t = Target(EmulatorConfig(
        subsystems=[SubsystemConfig(NQN, [NamespaceConfig(1, "64MiB")], allow_any_host=True)],
        listen=["127.0.0.1:0"])).start_in_thread()
    try:
        yield t
    finally:
        t.stop()


def _url(t: Target) -> str:
    return f"nvme+tcp://127.0.0.1:{t.port}/{NQN}/1"


@pytest.mark.integration
def test_media_identity_on_the_emulator_target(live_target: Target) -> None:
    url = _url(live_target)
    doc = prepare(settings(MULTI, {"gpu": "20blk", "dram": "40blk", "nvme": url},
                           block_bytes=65536 + 256)).run()
    media = doc["media"]
    assert media["source"] == "smart" and "error" not in media and media["counted"]
    expected = media["replay_padded_bytes"] + media["store_metadata_bytes"]
    assert media["replay_put_bytes"] == doc["measured"]["links"]["nvme<-gpu"]["bytes"]
    # SMART counts thousands of 512-byte units, rounded up: within one unit of the truth
    assert abs(media["media_bytes_written"] - expected) <= media["unit_bytes"]
    # a DRAM-only run writes nothing to the namespace
    from kvtool.nvme.engine import open_nvme_tcp

    with open_nvme_tcp(url, write=False, qd=2) as eng:
        before = eng.ctrl.smart_log(eng.nsid).data_units_written
        prepare(settings(MULTI, {"dram": "40blk"}, block_bytes=4096)).run()
        assert eng.ctrl.smart_log(eng.nsid).data_units_written == before


@pytest.mark.integration
def test_target_killed_mid_run(live_target: Target) -> None:
    url = _url(live_target)
    tiers = {"dram": "30blk", "nvme": url}
    job = prepare(settings(MULTI, tiers, block_bytes=8192, policy="lru"))
    eng = _engine(job)
    reqs = list(job.reader)
    try:
        for req in reqs[:40]:
            eng.feed(req)
        live_target.stop()
        with pytest.raises(TierFailed) as err:
            for req in reqs[40:]:
                eng.feed(req)
    finally:
        eng.close()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"nvme tier ({url})")
    assert line.endswith("stopped (on_tier_error recompute goes on without the tier)")


@pytest.mark.integration
def test_target_killed_mid_run_recompute(live_target: Target) -> None:
    url = _url(live_target)
    tiers = {"dram": "30blk", "nvme": url}
    job = prepare(settings(MULTI, tiers, block_bytes=8192, policy="lru",
                           on_tier_error="recompute"))
    events: list[str] = []
    eng = _engine(job)
    eng.on_event = events.append
    reqs = list(job.reader)
    try:
        for req in reqs[:40]:
            eng.feed(req)
        live_target.stop()
        for req in reqs[40:]:
            eng.feed(req)
        res = eng.result()
    finally:
        eng.close()
    assert res["requests"] == len(reqs)
    assert "nvme" in eng.dead and len(events) == 1 and url in events[0]
    assert res["tiers"][-1]["failed"]
    assert res["lost_blocks"] > 0 and res["corrupt_blocks"] == 0
    assert res["hit_tokens"]["total"] + res["recompute_tokens"] == res["input_tokens"]


def test_ctrl_c_gives_a_partial_report(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C "pressed" while the 31st request is served (the run decodes the trace once,
    # in prepare: the interruption is in the replay's own pass)
    from kvtool.replay.data import DataReplayer

    job = prepare(settings(MULTI, {"dram": "40blk", "nvme": f"100blk@{store_dir / 'i.img'}"},
                           block_bytes=4096, times="none"))
    real = DataReplayer.feed
    fed: list[int] = []

    def feed(self: DataReplayer, req: Any) -> Any:
        if len(fed) == 30:
            raise KeyboardInterrupt
        fed.append(1)
        return real(self, req)

    monkeypatch.setattr(DataReplayer, "feed", feed)
    doc = job.run()
    assert doc["interrupted"] is True and doc["requests"] == 30 == doc["requests_served"]


def test_cli_data_mode_bad_sizes_suggest_simulate(store_dir: Path) -> None:
    r = run("replay", MULTI, "--dram", "10TB")
    assert r.exit_code == 2 and "--simulate" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run("replay", MULTI, "--dram", "inf")
    assert r.exit_code == 2 and "--simulate" in r.stderr
    r = run("replay", MULTI, "--dram", "10blk", "--nvme", str(store_dir / "missing.img"))
    assert r.exit_code == 2 and "give a size" in r.stderr
    r = run("replay", MULTI, "--simulate", "--nvme", str(store_dir / "x.img"))
    assert r.exit_code == 2 and "place" in r.stderr


@pytest.fixture(scope="module")
def kernel_target_options() -> dict[str, Any]:
    # a loop device: the guest backing whose block layer keeps the I/O statistics nvmet's
    # SMART log reports (brd keeps none, a file namespace reports 0)
    return {"backing": "loop"}


def test_data_mode_on_the_kernel_target(kernel_target: Any) -> None:
    """The NVMe tier on the real Linux nvmet-tcp target in the QEMU guest: same hits as
    --simulate, every block checked, and media identity: the kernel's own SMART Data Units
    Written across the run match the replay's NVMe puts; a DRAM-only run writes nothing."""
    tiers = {"dram": "4blk", "nvme": "300blk"}
    sim = prepare(settings(TOKENS, tiers, simulate=True, block_bytes=65536 + 256)).run()
    doc = prepare(settings(TOKENS, {**tiers, "nvme": f"300blk@{kernel_target.url}"},
                           block_bytes=65536 + 256, read_qd=4)).run()
    same(doc, sim)
    assert doc["put_blocks"]["nvme"] > 0 and doc["verified_blocks"] > 0
    media = doc["media"]
    assert media["source"] == "smart" and "error" not in media and media["counted"], media
    assert media["replay_put_bytes"] == sum(
        v["bytes"] for k, v in doc["measured"]["links"].items() if k.startswith("nvme<-"))
    expected = media["replay_padded_bytes"] + media["store_metadata_bytes"]
    # Linux rounds sectors written up to thousands: within one 512,000-byte unit
    assert abs(media["media_bytes_written"] - expected) <= media["unit_bytes"], media
    from kvtool.nvme.engine import open_nvme_tcp

    with open_nvme_tcp(kernel_target.url, write=False, qd=2) as eng:
        before = eng.ctrl.smart_log(eng.nsid).data_units_written
        prepare(settings(TOKENS, {"dram": "40blk"}, block_bytes=65536 + 256)).run()
        assert eng.ctrl.smart_log(eng.nsid).data_units_written == before


def test_a_file_namespace_reports_not_counted(kernel_target: Any) -> None:
    """A file-backed nvmet namespace reports Data Units Written 0 whatever it takes: the
    report says the medium did not count, rather than claiming 0 B were written."""
    guest, nqn = kernel_target.guest, kernel_target.subnqn
    ns = f"/sys/kernel/config/nvmet/subsystems/{nqn}/namespaces/2"
    guest.check(f"truncate -s 32M /run/ns2.img && mkdir {ns} && "
                f"echo -n /run/ns2.img > {ns}/device_path && echo 1 > {ns}/buffered_io && "
                f"echo 1 > {ns}/enable")
    try:
        url = kernel_target.url.rsplit("/", 1)[0] + "/2"
        doc = prepare(settings(TOKENS, {"dram": "4blk", "nvme": f"200blk@{url}"},
                               block_bytes=65536 + 256)).run()
    finally:
        guest.check(f"echo 0 > {ns}/enable && rmdir {ns}")
    media = doc["media"]
    assert doc["put_blocks"]["nvme"] > 0 and media["replay_put_bytes"] > 0
    assert media["counted"] is False and media["data_units_written"] == 0, media


def test_place_syntax_in_compare_and_tiers_files(store_dir: Path, tmp_path: Path) -> None:
    from tests.conftest import run_json

    a, b = store_dir / "a.img", store_dir / "b.img"
    doc = run_json("replay", MULTI, "--block-bytes", "4096",
                   "--compare", f"dram=30blk,nvme=200blk@{a},label=A",
                   "--compare", "gpu=10blk,dram=60blk,label=B")
    assert [c["label"] for c in doc["configs"]] == ["A", "B"]
    assert doc["configs"][0]["tiers"][-1]["url"] == str(a)
    assert all(c["mode"] == "data" and c["verified_blocks"] > 0 for c in doc["configs"])
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[dram]\ncapacity = "30blk"\n[nvme]\ncapacity = "200blk@{b}"\n')
    doc2 = run_json("replay", MULTI, "--block-bytes", "4096", "--tiers", toml)
    assert doc2["tiers"][-1]["url"] == str(b)
    assert doc2["hit_tokens"] == doc["configs"][0]["hit_tokens"]


@pytest.mark.root
def test_nvme_tier_on_a_block_device(loop_device: Any) -> None:
    """``--nvme /dev/loopN``: the whole device (4 KiB sectors: objects pad to 4 KiB)."""
    dev = loop_device(48 << 20, sector_size=4096)
    tiers = {"gpu": "10blk", "dram": "30blk"}
    sim = prepare(settings(MULTI, {**tiers, "nvme": "inf"}, simulate=True,
                           block_bytes=65536 + 256)).run()
    data = prepare(settings(MULTI, {**tiers, "nvme": dev}, block_bytes=65536 + 256)).run()
    nvme = data["tiers"][-1]
    assert nvme["url"] == dev and nvme["capacity_blocks"] >= 480  # the trace's unique blocks
    same(data, sim)


def test_plain_replay_without_a_target_uses_a_store_file(store_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvtool replay trace.jsonl` with nothing up: default tiers, the NVMe tier on a store
    file in the cache directory; 16-token blocks keep DeepSeek-V4-Flash's bytes per token."""
    from tests.conftest import run_json

    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(store_dir))
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    doc = run_json("replay", TOKENS)
    assert doc["mode"] == "data" and doc["setup"]["defaults"] is True
    assert doc["block_bytes"] == -(-1_002_240 * 16 // 256)
    assert doc["tiers"][-1]["url"] == str(store_dir / "replay-nvme.img")
    assert [t["name"] for t in doc["tiers"]] == ["gpu", "dram", "nvme"]


def test_a_trace_that_does_not_fit_says_so_and_the_label_has_real_capacities(
        store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVMe place without a size reports the blocks it holds (never "inf"), and a
    trace with more distinct blocks than the largest tier gets one line with the size
    that would hold them; the default place names itself and how to remove it."""
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(store_dir))
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    place = store_dir / "small.img"
    r = run("replay", str(FIXTURES / "traces" / "multiturn-8x12.jsonl"), "--gpu", "32MiB",
            "--dram", "64MiB", "--nvme", f"150MiB@{place}")
    assert r.exit_code == 0, r.stderr
    said = " ".join(r.stderr.split())
    assert "480 distinct blocks (481.08 MB) do not fit the largest tier (nvme:" in said
    plain = run("replay", TOKENS)
    assert plain.exit_code == 0, plain.stderr
    text = " ".join(plain.stderr.split())
    # a path longer than the terminal is folded: compare without any whitespace
    assert f"rm{store_dir / 'replay-nvme.img'}removesit" in "".join(text.split())
    assert "do not fit" not in text
    assert "inf@" not in plain.stdout
