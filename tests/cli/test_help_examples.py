"""Every example in every ``--help`` runs and exits 0.

Examples are collected from the commands themselves, so a new example is run without
touching this file. They run in a scratch directory holding ``fixtures/`` and the files the
examples name (traces, a tiers file, an extents file, a tensor file). Device paths
(``/dev/loop3``, ``/dev/nvme1n1``, ``/var/tmp/*.img``) become O_DIRECT files prepared as the
example expects (a blank target, or a loaded store); only the sizes that would make CI
slow are overridden (``--count``, ``--seconds``, ``--region``), by appending the option
again (click keeps the last value). ``kvtool target`` examples run in order against the
demo target on a free port. What cannot run here is listed in ``SKIP`` with the reason.
"""

from __future__ import annotations

import json
import shlex
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from kvtool.cli.main import cli
from tests.conftest import FIXTURES, STORE_DIR, free_port
from tests.helpers.widths import WIDTHS, checking_widths

DEMO_NQN = "nqn.2026-01.io.kvtool:demo"
HOST = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-4222-8222-222222222222"


def collect() -> list[str]:
    """Every example line (continuations joined) of every command's epilog, in order."""
    out: list[str] = []
    ctx = click.Context(cli)

    def walk(cmd: click.Command) -> None:
        lines = (cmd.epilog or "").splitlines()
        cur: str | None = None
        for line in lines:
            s = line.strip()
            if cur is not None:
                cur += " " + s.rstrip("\\").strip()
            elif s.startswith("kvtool "):
                cur = s.split("  #")[0].rstrip("\\").strip()
            if cur is not None and not s.endswith("\\"):
                if cur not in out:
                    out.append(cur)
                cur = None
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                walk(sub)

    walk(cli)
    return out


RDMA_GUEST = ("the kernel's NVMe-oF host (/dev/nvme-fabrics), which this kernel lacks: "
              "tests/rdma/test_guest_rdma.py runs it in the QEMU guest")
SKIP = {
    "kvtool replay mt.jsonl --engine vllm --check-outputs":
        "needs vLLM (kvtool[vllm], a 3.9 GB virtualenv): tests/integrations/test_engine_replay.py "
        "runs replay --engine vllm --check-outputs in the cached engine venv",
    "kvtool bench --cluster fixtures/clusters/gp7000-mini.toml --block-bytes 1MiB --qd 8":
        "needs the cluster up (root, network namespaces, Ray): "
        "tests/cluster/test_netns_cluster.py runs bench --cluster on one",
    "kvtool target up /etc/nvmet/config.json --backend nvmet --configfs-root "
    "/sys/kernel/config/nvmet": "configures the kernel's nvmet (root, configfs): "
                                "tests/target/test_qemu.py runs it in the QEMU guest",
    "kvtool target ana fixtures/targets/multipath.toml --listener 127.0.0.1:4421 --state "
    "inaccessible": "needs the multipath target up: tests/target/test_ana.py runs it on free ports",
    "kvtool target ana --name multipath --listener 127.0.0.1:4420 --group 1 --state optimized":
        "needs the multipath target up: tests/target/test_ana.py runs it on free ports",
    "kvtool target up fixtures/targets/spdk-production.toml --allow-remote --dry-run":
        "plans against a running spdk_tgt's state: tests/target/test_spdk.py runs it against "
        "an SPDK peer",
    # the kernel's NVMe-oF host: this kernel has neither nvme-rdma nor nvme-tcp
    "kvtool target discover 10.0.2.15:4420 --transport rdma":
        RDMA_GUEST,
    "kvtool target connect nvme+rdma://10.0.2.15:4420/nqn.2026-01.io.kvtool:kernel/1":
        RDMA_GUEST,
    "kvtool target connect nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo --json":
        RDMA_GUEST,
    "kvtool target disconnect /dev/nvme3n1": RDMA_GUEST,
    "kvtool target disconnect nvme+rdma://10.0.2.15:4420/nqn.2026-01.io.kvtool:kernel":
        RDMA_GUEST,
}

# Run in this order against one demo target (listening on a free port).
TARGET_SEQUENCE = [
    "kvtool target up fixtures/targets/demo.toml",
    "kvtool target status",
    "kvtool target status fixtures/targets/demo.toml --json",
    "kvtool target status --name demo --url",
    "kvtool target discover 127.0.0.1:4420",
    "kvtool target discover 192.168.1.10 --json",
    "kvtool load nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo/1 --object-bytes 1002240",
    "kvtool target down --name demo --dry-run",
    "kvtool target down fixtures/targets/demo.toml",
    # the built-in default target, and data-mode replays on its namespace
    "kvtool target up",
    "kvtool replay trace.jsonl",
    "kvtool replay trace.jsonl --dram 512MiB --read-qd 32 "
    "--nvme nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:default/1",
    "kvtool target down",
]

# Example → (path substitutions, options appended).
OVERRIDES: dict[str, tuple[dict[str, str], list[str]]] = {
    "kvtool bench /var/tmp/bench.img --create 2GiB --model deepseek-v4-flash --dtype fp8":
        ({}, ["--seconds", "0.05", "--region", "16MiB", "--qd", "1,4"]),
    "kvtool bench /var/tmp/bench.img --model deepseek-v4-flash --pattern rand-read --need 2.5":
        ({}, ["--seconds", "0.05", "--region", "16MiB", "--qd", "1", "--repeat", "2",
              "--need", "0.001", "--create", "64MiB"]),
    "kvtool bench /dev/loop3 --block-bytes 32MiB --qd 1,8,32 --seconds 3 --force":
        ({"/dev/loop3": "blank.img"},
         ["--seconds", "0.05", "--region", "64MiB", "--qd", "1"]),
    "kvtool bench /dev/nvme1n1 --model llama-3-70b --read-only --pattern rand-read --json":
        ({}, ["--seconds", "0.05", "--region", "160MiB"]),
    "kvtool load /var/tmp/kv.img --create 4GiB --block-bytes 32MiB --count 100":
        ({"/var/tmp/kv.img": "kv-new.img"}, ["--count", "2"]),
    "kvtool load /dev/nvme1n1 --model llama-3-70b --tp 4 --count 10000 --ack-file acks.jsonl":
        ({"/dev/nvme1n1": "blank-nvme.img"}, ["--count", "2"]),
}

# Examples that show a failing check (exit 1) on purpose.
EXIT = {"kvtool audit --object-bytes 1002240 --layout packed:offset=0,count=1000 --strict": 1}

PATHS = {"/dev/loop3": "loop3.img", "/dev/nvme1n1": "nvme1n1.img",
         "/var/tmp/kv.img": "kv.img", "/var/tmp/bench.img": "bench.img",
         "/var/tmp/kv-cache.img": "kv-cache.img"}


def _invoke(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    stdout_to = None
    if ">" in args:
        i = args.index(">")
        args, stdout_to = args[:i], args[i + 1]
    result = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
    if stdout_to is not None:
        (cwd / stdout_to).write_text(result.stdout)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(working directory, O_DIRECT directory) with everything the examples read."""
    wd = tmp_path_factory.mktemp("examples")
    (wd / "fixtures").symlink_to(FIXTURES)
    trace = FIXTURES / "traces" / "multiturn-8x12.jsonl"
    for name in ("trace.jsonl", "mt.jsonl", "t.jsonl", "multiturn.jsonl"):
        shutil.copy(trace, wd / name)
    (wd / "tiers.toml").write_text('[dram]\ncapacity = "40blk"\n[nvme]\ncapacity = "inf"\n')
    (wd / "extents.csv").write_text("offset,length\n0,1048576\n1048576,1048576\n")
    np.arange(1 << 16, dtype=np.float32).tofile(wd / "tensor.raw")
    np.save(wd / "kv_block.npy", np.arange(1 << 16, dtype=np.float16))
    STORE_DIR.mkdir(parents=True, exist_ok=True)
    dev = STORE_DIR / f"examples-{uuid.uuid4().hex[:8]}"
    dev.mkdir()
    for args in (["trace", "gen", "--sessions", "4", "--rounds", "6", "--input-tokens", "600",
                  "--output-tokens", "200", "--block-tokens", "512", "--format", "hash_ids",
                  "-o", str(wd / "mc512.jsonl")],
                 ["trace", "convert", str(wd / "mc512.jsonl"), "--to", "mooncake", "-o",
                  str(wd / "conversation_trace.jsonl")]):
        code, _, err = _invoke(args, wd, {})
        assert code == 0, err
    shutil.copy(wd / "conversation_trace.jsonl", wd / "mooncake.jsonl")
    for name, size in (("loop3.img", 64), ("nvme1n1.img", 256), ("kv.img", 64),
                       ("blank.img", 64), ("blank-nvme.img", 128)):
        with open(dev / name, "wb") as f:
            f.truncate(size << 20)
    for args in (["load", "loop3.img", "--model", "deepseek-v4-flash", "--dtype", "fp8",
                  "--count", "8"],
                 ["load", "nvme1n1.img", "--model", "llama-3-70b", "--tp", "4", "--count",
                  "2", "--payload-file", str(wd / "kv_block.npy")],
                 ["load", "kv.img", "--block-bytes", "1MiB", "--count", "20"]):
        code, _, err = _invoke([args[0], str(dev / args[1]), *args[2:]], wd, {})
        assert code == 0, (args, err)
    yield wd, dev
    shutil.rmtree(dev, ignore_errors=True)


def _skip_reason(example: str) -> str | None:
    if example in SKIP:
        return SKIP[example]
    if example.startswith("kvtool pool"):
        return ("starts a Mooncake Store (the mooncake extra) on its default ports: "
                "tests/mooncake/test_pool.py runs it on free ports")
    return None


def _args(example: str, dev: Path, subs: dict[str, str], extra: list[str]) -> list[str]:
    words = shlex.split(example)[1:]
    paths = {**PATHS, **subs}

    def sub(w: str) -> str:
        size, at, path = w.rpartition("@")
        if at and path in paths:  # a tier option SIZE@PLACE
            return f"{size}@{dev / paths[path]}"
        return str(dev / paths[w]) if w in paths else w
    return [sub(w) for w in words] + extra


ALL = collect()
GENERIC = [e for e in ALL if e not in TARGET_SEQUENCE]


def test_every_example_is_accounted_for() -> None:
    assert len(ALL) > 40
    for listed in (*SKIP, *TARGET_SEQUENCE, *OVERRIDES, *EXIT):
        assert listed in ALL, f"stale entry, no --help shows it any more: {listed}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("example", GENERIC)
def test_example_runs(example: str, world: tuple[Path, Path],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    wd, dev = world
    reason = _skip_reason(example)
    if reason:
        pytest.skip(reason)
    if "fx100-parallel-read" in example and not (
            FIXTURES / "experiments" / "fx100-parallel-read.toml").exists():
        pytest.skip("fx100-parallel-read is not in fixtures/experiments yet")
    monkeypatch.chdir(wd)
    subs, extra = OVERRIDES.get(example, ({}, []))
    with checking_widths(monkeypatch) as problems:
        code, out, err = _invoke(_args(example, dev, subs, extra), wd,
                                 {"KVTOOL_STATE_DIR": str(wd / "state")})
    assert code == EXIT.get(example, 0), f"{example}\n{err}{out[-2000:]}"
    if "--json" in example:
        json.loads(out)
    assert not problems, "\n".join(problems)


@pytest.mark.integration
@pytest.mark.slow
def test_target_examples_run_in_order(world: tuple[Path, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    wd, _ = world
    monkeypatch.chdir(wd)
    port = str(free_port())
    demo = (FIXTURES / "targets" / "demo.toml").read_text().replace("port = 4420",
                                                                      f"port = {port}")
    assert port in demo
    (wd / "demo.toml").write_text(demo)
    env = {"KVTOOL_STATE_DIR": str(wd / "target-state"), "KVTOOL_HOSTNQN": HOST}
    try:
        for example in TARGET_SEQUENCE:
            text = (example.replace("fixtures/targets/demo.toml", "demo.toml")
                    .replace("127.0.0.1:4420", f"127.0.0.1:{port}")
                    .replace("192.168.1.10", f"127.0.0.1:{port}"))
            if text == "kvtool target up":
                text += f" --port {port}"
            with checking_widths(monkeypatch) as problems:
                code, out, err = _invoke(shlex.split(text)[1:], wd, env)
            assert code == 0, f"{example}\n{err}{out[-2000:]}"
            assert not problems, f"{example}\n" + "\n".join(problems)
            if "--url" in example:
                assert out.strip() == f"nvme+tcp://127.0.0.1:{port}/{DEMO_NQN}/1"
    finally:
        _invoke(["target", "down", "--name", "demo"], wd, env)
        _invoke(["target", "down", "--name", "kvtool"], wd, env)


def _all_commands() -> list[list[str]]:
    ctx = click.Context(cli)
    out: list[list[str]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        out.append(path)
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                walk(sub, [*path, name])

    walk(cli, [])
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_every_help_fits_the_terminal(width: int) -> None:
    """No --help line is longer than an 80- or 120-column terminal (examples included:
    click does not rewrap them, the terminal would break them mid-word)."""
    for path in _all_commands():
        result = CliRunner().invoke(cli, [*path, "--help"], terminal_width=width)
        assert result.exit_code == 0, result.output
        long = [line for line in result.output.splitlines() if len(line) > width]
        assert not long, f"kvtool {' '.join(path)} --help at {width} columns:\n" + "\n".join(long)
