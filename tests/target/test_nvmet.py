"""The nvmet backend against a simulated nvmet configfs (pyfakefs + the kernel's rules).

Every plan is applied through :class:`FakeNvmetKernel`, which refuses what the real kernel
refuses (EBUSY, EACCES, ENOTEMPTY, EINVAL, EEXIST...). A plan in the wrong order therefore
fails here as it would on a real machine.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator

import pytest

# A module imported for the first time inside a pyfakefs test is unloaded afterwards while
# its package keeps the patched module object (`from kvtool.target import procs` would
# return it, with the fake os): import what the emulator runtimes need before any fake file
# system is up.
import kvtool.target.emulator  # noqa: F401
from kvtool.target.config import TargetConfig
from kvtool.target.loader import parse_config
from kvtool.target.nvmet import nvmetcli
from kvtool.target.nvmet.backend import NvmetBackend
from kvtool.target.nvmet.configfs import ConfigfsError
from kvtool.target.plan import ApplyFailed, TargetError, apply
from tests.helpers.fake_nvmet import ROOT, FakeNvmetKernel, snapshot

H1 = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"
H2 = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-4222-8222-222222222222"
S1 = "nqn.2026-01.io.kvtool:one"
S2 = "nqn.2026-01.io.kvtool:two"

BASE = f"""
backend = "nvmet"
name = "t"
[[subsystem]]
nqn = "{S1}"
serial = "KVT0001"
hosts = ["{H1}"]
  [[subsystem.namespace]]
  nsid = 1
  path = "/data/ns1.img"
  [[subsystem.namespace]]
  nsid = 2
  path = "/data/ns2.img"
[[subsystem]]
nqn = "{S2}"
hosts = ["{H1}", "{H2}"]
  [[subsystem.namespace]]
  nsid = 1
  path = "/data/ns3.img"
  buffered_io = true
[[listener]]
id = 1
address = "127.0.0.1"
port = 4420
[[listener]]
id = 2
address = "127.0.0.1"
port = 4421
subsystems = ["{S2}"]
"""


def cfg_of(text: str) -> TargetConfig:
    return parse_config(text, source="t.toml")


@pytest.fixture
def kernel(fs: object) -> Iterator[FakeNvmetKernel]:
    os.makedirs("/data")
    for name in ("ns1.img", "ns2.img", "ns3.img", "alt.img"):
        with open(f"/data/{name}", "wb") as f:
            f.truncate(64 << 20)
    yield FakeNvmetKernel()


@pytest.fixture
def backend(kernel: FakeNvmetKernel) -> NvmetBackend:
    return NvmetBackend(cfs=kernel, manage_modules=False)


def up(backend: NvmetBackend, cfg: TargetConfig, previous: TargetConfig | None = None) -> int:
    return apply(backend.plan_up(cfg, previous))


def test_up_builds_the_tree_in_kernel_order(backend: NvmetBackend, kernel: FakeNvmetKernel) -> None:
    cfg = cfg_of(BASE)
    n = up(backend, cfg)
    assert n > 10
    tree = snapshot()
    assert tree[f"subsystems/{S1}/namespaces/1/device_path"] == "/data/ns1.img\n"
    assert tree[f"subsystems/{S1}/namespaces/2/enable"] == "1\n"
    assert tree[f"subsystems/{S2}/namespaces/1/buffered_io"] == "1\n"
    assert tree[f"subsystems/{S1}/attr_serial"] == "KVT0001\n"
    assert tree[f"subsystems/{S2}/allowed_hosts/{H2}"] == f"-> {ROOT}/hosts/{H2}"
    assert tree["ports/1/addr_traddr"] == "127.0.0.1\n"
    assert tree["ports/2/addr_trsvcid"] == "4421\n"
    assert tree[f"ports/1/subsystems/{S1}"] == f"-> {ROOT}/subsystems/{S1}"
    assert f"ports/2/subsystems/{S1}" not in tree
    # namespaces are enabled before any port link makes them reachable
    ops = [f"{op} {arg}" for op, arg in kernel.ops]
    first_link = next(i for i, o in enumerate(ops) if o.startswith("symlink ports/"))
    last_enable = max(i for i, o in enumerate(ops) if o.endswith("/enable=1"))
    assert last_enable < first_link
    # addr_trtype is written before the other address attributes (it resets tsas)
    port_writes = [o for o in ops if o.startswith("write ports/1/addr_")]
    assert port_writes[0].startswith("write ports/1/addr_trtype")


def test_up_twice_is_a_no_op(backend: NvmetBackend) -> None:
    cfg = cfg_of(BASE)
    up(backend, cfg)
    before = snapshot()
    plan = backend.plan_up(cfg)
    assert plan.empty, [s.describe() for s in plan.steps]
    assert snapshot() == before


def test_status_reports_sizes_lba_and_listeners(backend: NvmetBackend) -> None:
    cfg = cfg_of(BASE)
    up(backend, cfg)
    st = backend.status(cfg)
    s1 = st["subsystems"][0]
    assert s1["state"] == "up"
    assert [ns["nsid"] for ns in s1["namespaces"]] == [1, 2]
    lba = s1["namespaces"][0]["block_size"]
    assert lba in (512, 1024, 2048, 4096)
    assert s1["namespaces"][0]["size"] == (64 << 20) // lba * lba
    assert [(x["address"], x["port"]) for x in s1["listeners"]] == [("127.0.0.1", 4420)]
    s2 = st["subsystems"][1]
    assert sorted(x["port"] for x in s2["listeners"]) == [4420, 4421]
    assert s2["hosts"] == sorted([H1, H2])


def _foreign(kernel: FakeNvmetKernel) -> None:
    """Objects another admin made: a subsystem allowing H1 on its own port 7."""
    other = "nqn.2026-01.org.example:other"
    kernel.mkdir(f"hosts/{H1}") if not kernel.exists(f"hosts/{H1}") else None
    kernel.mkdir(f"subsystems/{other}")
    kernel.symlink(f"hosts/{H1}", f"subsystems/{other}/allowed_hosts/{H1}")
    kernel.mkdir("ports/7")
    for attr, v in (("addr_trtype", "tcp"), ("addr_adrfam", "ipv4"), ("addr_traddr", "127.0.0.1"),
                    ("addr_trsvcid", "4499")):
        kernel.write(f"ports/7/{attr}", v)
    kernel.symlink(f"subsystems/{other}", f"ports/7/subsystems/{other}")


def test_down_removes_only_what_the_config_owns(backend: NvmetBackend, kernel: FakeNvmetKernel) -> None:
    cfg = cfg_of(BASE)
    up(backend, cfg)
    _foreign(kernel)
    plan = backend.plan_down(cfg)
    apply(plan)  # the simulated kernel refuses any step out of teardown order
    tree = snapshot()
    assert not any(k.startswith(f"subsystems/{S1}") or k.startswith(f"subsystems/{S2}") for k in tree)
    assert "ports/1" not in tree and "ports/2" not in tree
    assert "ports/7" in tree and "subsystems/nqn.2026-01.org.example:other" in tree
    assert f"hosts/{H1}" in tree  # still allowed by the foreign subsystem
    assert f"hosts/{H2}" not in tree
    assert any("kept" in n for n in plan.notes)
    # teardown order: links, ports, namespaces, allowed hosts, subsystems, hosts
    kinds = [f"{s.action} {s.kind}" for s in plan.steps]
    assert kinds.index("unlink port") < kinds.index("delete port") < kinds.index("delete namespace")
    assert kinds.index("unlink allowed_host") < kinds.index("delete subsystem") < kinds.index("delete host")
    assert backend.plan_down(cfg).empty  # nothing left to remove


def test_changing_a_backing_disables_the_namespace_first(backend: NvmetBackend) -> None:
    up(backend, cfg_of(BASE))
    changed = cfg_of(BASE.replace("/data/ns2.img", "/data/alt.img"))
    plan = backend.plan_up(changed)
    targets = [s.target for s in plan.steps]
    ns2 = f"subsystems/{S1}/namespaces/2"
    assert targets == [f"{ns2}/enable", f"{ns2}/device_path", f"{ns2}/enable"]
    apply(plan)  # EBUSY if device_path were written while enabled
    assert snapshot()[f"{ns2}/device_path"] == "/data/alt.img\n"
    assert backend.plan_up(changed).empty


def test_changing_a_port_address_unlinks_first(backend: NvmetBackend) -> None:
    up(backend, cfg_of(BASE))
    moved = cfg_of(BASE.replace("port = 4421", "port = 4431"))
    plan = backend.plan_up(moved)
    actions = [(s.action, s.target) for s in plan.steps]
    assert actions == [("unlink", f"ports/2/subsystems/{S2}"),
                       ("update", "ports/2/addr_trsvcid"),
                       ("link", f"ports/2/subsystems/{S2}")]
    apply(plan)  # EACCES if the address were written while the port is enabled
    assert snapshot()["ports/2/addr_trsvcid"] == "4431\n"


def test_dropped_namespace_and_host_are_removed(backend: NvmetBackend) -> None:
    up(backend, cfg_of(BASE))
    smaller = cfg_of(BASE.replace(f'hosts = ["{H1}", "{H2}"]', f'hosts = ["{H2}"]').replace(
        '  [[subsystem.namespace]]\n  nsid = 2\n  path = "/data/ns2.img"\n', ""))
    apply(backend.plan_up(smaller))
    tree = snapshot()
    assert f"subsystems/{S1}/namespaces/2" not in tree
    assert f"subsystems/{S2}/allowed_hosts/{H1}" not in tree
    assert backend.plan_up(smaller).empty


def test_previous_config_objects_are_torn_down(backend: NvmetBackend) -> None:
    old = cfg_of(BASE)
    up(backend, old)
    new = cfg_of(BASE.split("[[subsystem]]\nnqn = \"" + S2)[0] + """
[[listener]]
id = 1
address = "127.0.0.1"
port = 4420
""")
    apply(backend.plan_up(new, previous=old))
    tree = snapshot()
    assert f"subsystems/{S2}" not in tree and "ports/2" not in tree
    assert f"hosts/{H2}" not in tree and f"hosts/{H1}" in tree
    assert backend.plan_up(new, previous=old).empty


@pytest.mark.parametrize("op,suffix,code", [
    ("write", f"{S2}/namespaces/1/enable", errno.EIO),
    ("symlink", f"ports/2/subsystems/{S2}", errno.EADDRINUSE),
    ("mkdir", "ports/2", errno.ENOMEM),
    ("write", "ports/1/addr_trsvcid", errno.EINVAL),
])
def test_failure_half_way_rolls_back_a_fresh_up(backend: NvmetBackend, kernel: FakeNvmetKernel,
                                                op: str, suffix: str, code: int) -> None:
    before = snapshot()
    kernel.inject(op, suffix, code)
    with pytest.raises(ApplyFailed) as info:
        up(backend, cfg_of(BASE))
    assert info.value.rolled_back
    assert errno.errorcode[code] in str(info.value)
    assert "rolled back" in str(info.value)
    assert snapshot() == before


def test_failure_rolls_back_an_update_to_the_previous_tree(backend: NvmetBackend,
                                                         kernel: FakeNvmetKernel) -> None:
    up(backend, cfg_of(BASE))
    before = snapshot()
    changed = cfg_of(BASE.replace("/data/ns2.img", "/data/alt.img").replace("port = 4421", "port = 4431")
                     + f'[[listener]]\nid = 3\naddress = "127.0.0.1"\nport = 4440\nsubsystems = ["{S1}"]\n')
    kernel.claimed.add("/data/alt.img")  # someone holds it exclusively: enable=1 → EBUSY
    with pytest.raises(ApplyFailed) as info:
        apply(backend.plan_up(changed))
    assert "EBUSY" in str(info.value) and "claimed exclusively" in str(info.value)
    assert snapshot() == before
    # the last step failing (a link) rolls back too
    kernel.claimed.clear()
    kernel.inject("symlink", f"ports/3/subsystems/{S1}", errno.EADDRNOTAVAIL)
    with pytest.raises(ApplyFailed):
        apply(backend.plan_up(changed))
    assert snapshot() == before


def test_failed_down_restores_everything(backend: NvmetBackend, kernel: FakeNvmetKernel) -> None:
    up(backend, cfg_of(BASE))
    before = snapshot()
    kernel.inject("rmdir", f"hosts/{H2}", errno.EBUSY)
    with pytest.raises(ApplyFailed) as info:
        apply(backend.plan_down(cfg_of(BASE)))
    assert info.value.rolled_back, info.value.rollback_errors
    assert snapshot() == before


def test_errno_explanations(backend: NvmetBackend, kernel: FakeNvmetKernel) -> None:
    up(backend, cfg_of(BASE))
    root = backend.root
    ns = root.subsystem(S1).namespace(1)
    with pytest.raises(ConfigfsError) as e:
        ns.set("device_path", "/data/alt.img")
    assert e.value.errno == errno.EBUSY and "write 0 to 'enable'" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.port(1).set("addr_trsvcid", "4999")
    assert e.value.errno == errno.EACCES and "unlink its subsystems" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.subsystem(S1).delete()
    assert e.value.errno == errno.EBUSY and "linked from a port" in str(e.value)
    root.port(1).unlink(S1)
    with pytest.raises(ConfigfsError) as e:
        root.subsystem(S1).delete()
    assert e.value.errno == errno.ENOTEMPTY and "namespaces or allowed_hosts" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.port(1).delete()
    assert e.value.errno == errno.ENOTEMPTY and "subsystem links" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.host(H1).delete()
    assert e.value.errno == errno.EBUSY and "allowed_hosts" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.subsystem(S1).set("attr_allow_any_host", "1")
    assert e.value.errno == errno.EINVAL and "explicit hosts" in str(e.value)
    with pytest.raises(ConfigfsError) as e:
        root.subsystem(S2).allow_host(H1)
    assert e.value.errno == errno.EEXIST


def test_allow_any_host_switch_unlinks_hosts_first(backend: NvmetBackend) -> None:
    up(backend, cfg_of(BASE))
    text = BASE.replace(f'hosts = ["{H1}"]\n', "allow_any_host = true\n", 1)
    apply(backend.plan_up(cfg_of(text)))  # EINVAL if allow_any_host=1 came before the unlink
    tree = snapshot()
    assert tree[f"subsystems/{S1}/attr_allow_any_host"] == "1\n"
    assert not any(k.startswith(f"subsystems/{S1}/allowed_hosts/") for k in tree)


def test_port_clash_with_a_foreign_port(backend: NvmetBackend, kernel: FakeNvmetKernel) -> None:
    _foreign(kernel)
    clash = cfg_of(BASE.replace("port = 4421", "port = 4499"))
    with pytest.raises(TargetError, match="port clash: ports/7"):
        backend.plan_up(clash)


def test_missing_configfs_is_reported(fs: object) -> None:
    backend = NvmetBackend("/nowhere/nvmet", manage_modules=False)
    with pytest.raises(TargetError, match="nvmet configfs not found at /nowhere/nvmet"):
        backend.plan_up(parse_config(BASE, check_paths=False))


def test_nvmetcli_round_trip(backend: NvmetBackend) -> None:
    cfg = cfg_of(BASE)
    up(backend, cfg)
    dumped = nvmetcli.dump_tree(backend.root)
    assert {s["nqn"] for s in dumped["subsystems"]} == {S1, S2}
    assert dumped["ports"][0]["addr"]["trsvcid"] == "4420"
    # the live tree read back as a config is the same desired state
    again = parse_config(json.dumps(dumped), source="config.json", is_json=True)
    assert again.backend == "nvmet"
    assert [(s.nqn, [n.path for n in s.namespaces], sorted(s.hosts)) for s in again.subsystems] == \
        [(s.nqn, [n.path for n in s.namespaces], sorted(s.hosts)) for s in cfg.subsystems]
    assert [(lst.id, lst.port, lst.subsystems) for lst in again.listeners] == \
        [(lst.id, lst.port, lst.subsystems) for lst in cfg.listeners]
    assert NvmetBackend(cfs=backend.cfs, manage_modules=False).plan_up(again).empty
    # and the desired state in nvmetcli form has the same shape
    desired = nvmetcli.from_config(cfg)
    assert [p["portid"] for p in desired["ports"]] == [1, 2]
    assert desired["subsystems"][1]["allowed_hosts"] == [H1, H2]


def test_emulator_kernel_runtime_serves_memory_namespaces_from_tmpfs(kernel: FakeNvmetKernel) -> None:
    from kvtool.target.emulator import KernelRuntime
    runtime = KernelRuntime(backend=NvmetBackend(cfs=kernel, manage_modules=False))
    cfg = cfg_of(f"""
backend = "emulator"
name = "emu"
[emulator]
runtime = "kernel"
[[subsystem]]
nqn = "{S1}"
hosts = ["{H1}"]
  [[subsystem.namespace]]
  nsid = 1
  size = "4MiB"
[[listener]]
address = "127.0.0.1"
port = 4420
""")
    apply(runtime.plan_up(cfg))
    tree = snapshot()
    assert tree[f"subsystems/{S1}/namespaces/1/device_path"] == "/dev/shm/kvtool/emu-s0n1.img\n"
    assert tree[f"subsystems/{S1}/namespaces/1/buffered_io"] == "1\n"
    assert os.path.getsize("/dev/shm/kvtool/emu-s0n1.img") == 4 << 20
    st = runtime.status(cfg)
    assert st["runtime"] == "kernel" and st["subsystems"][0]["namespaces"][0]["size"] == 4 << 20
    assert runtime.plan_up(cfg).empty
    apply(runtime.plan_down(cfg))
    assert not any(k.startswith("subsystems/") and k != "subsystems" for k in snapshot())


AUTH = f"""
[[host]]
nqn = "{H1}"
dhchap_key_file = "/keys/h1.key"
dhchap_ctrl_key_file = "/keys/c1.key"
dhchap_hashes = ["sha384"]
dhchap_dhgroups = ["ffdhe3072", "ffdhe2048"]
"""


def _keys() -> dict[str, str]:
    from kvtool.nvme import dhchap
    os.makedirs("/keys")
    out = {}
    for name in ("h1", "c1"):
        secret = dhchap.generate_secret()
        dhchap.write_secret_file(f"/keys/{name}.key", secret)
        out[name] = secret.encode()
    return out


def test_host_keys_go_to_configfs_from_key_files(backend: NvmetBackend) -> None:
    keys = _keys()
    plan = backend.plan_up(cfg_of(BASE + AUTH))
    assert not [s for s in plan.steps if "DHHC-1" in s.detail + s.target]  # only file names
    assert any("one hash and one DH group" in n for n in plan.notes)
    apply(plan)
    tree = snapshot()
    assert tree[f"hosts/{H1}/dhchap_key"].strip() == keys["h1"]
    assert tree[f"hosts/{H1}/dhchap_ctrl_key"].strip() == keys["c1"]
    assert tree[f"hosts/{H1}/dhchap_hash"].strip() == "hmac(sha384)"
    assert tree[f"hosts/{H1}/dhchap_dhgroup"].strip() == "ffdhe3072"
    assert tree[f"hosts/{H2}/dhchap_key"].strip() == ""  # a host without keys stays open
    assert backend.plan_up(cfg_of(BASE + AUTH)).steps == []  # compared with the live values


def test_kernel_without_nvmet_auth_is_named(backend: NvmetBackend) -> None:
    """Debian bookworm's 6.1 has no hosts/<NQN>/dhchap_* attributes."""
    _keys()
    plan = backend.plan_up(cfg_of(BASE + AUTH))
    create_host = next(i for i, s in enumerate(plan.steps)
                       if s.kind == "host" and s.action == "create" and H1 in s.target)
    apply_host = plan.steps[create_host].do
    assert apply_host is not None

    def host_without_auth() -> None:
        apply_host()
        for attr in ("dhchap_key", "dhchap_ctrl_key", "dhchap_hash", "dhchap_dhgroup"):
            os.unlink(f"{ROOT}/hosts/{H1}/{attr}")

    plan.steps[create_host].do = host_without_auth
    with pytest.raises(ApplyFailed, match="CONFIG_NVME_TARGET_AUTH"):
        apply(plan)
