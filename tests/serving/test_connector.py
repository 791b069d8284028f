"""Framework costs as inputs and P/D through the store (issue 38, items 5 and 6).

``[connector]``: a load pays the connector's lookup once and its per-chunk cost per chunk,
after its last byte; every transfer between an engine and the tiers below shares one
ceiling per engine (WQS: 300–350 Gb/s whatever the NIC), so a faster NIC changes nothing
once the connector is the limit. ``pd_transfer = "store"``: the prefill engine writes the
prompt's KV to the tiers below and the decode engine reads it back (WQS's design); each
request then crosses the store twice, where the direct transfer goes engine to engine.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvtool import compiled
from kvtool.errors import InputError
from kvtool.serving.load import Load
from kvtool.serving.setup import build_setup
from kvtool.serving.sim import Simulation
from kvtool.serving.topology import ConnectorSpec, load_cluster
from kvtool.trace import read_trace

ENGINE = ('[[engine]]\nnode = "n0"\ngpu = "a100-sxm"\nmodel = "llama-3-8b"\ntp = 1\n'
          'enable_prefix_caching = false\n')
NODE = '[[node]]\nname = "n0"\nnic_gbps = {nic}\n'
STORE = ('[nvme]\ncapacity = "inf"\n[[nvme.target]]\nname = "t0"\nread_gbps = 100\n'
         'write_gbps = 100\n')


def trace(tmp: Path, n: int = 4, tokens: int = 8192, rounds: int = 2) -> Path:
    """``n`` prompts of ``tokens``, sent ``rounds`` times (each round all at once)."""
    p = tmp / "t.jsonl"
    with open(p, "w") as f:
        for r in range(rounds):
            for i in range(n):
                keys = [i * 1000 + j for j in range(tokens // 16)]
                f.write(json.dumps({"timestamp": r * 60_000, "input_length": tokens,
                                    "output_length": 8, "hash_ids": keys,
                                    "block_tokens": 16}) + "\n")
    return p


def run(tmp: Path, body: str, t: Path) -> tuple[Simulation, dict]:
    c = tmp / "c.toml"
    c.write_text(body)
    reader = read_trace(str(t))
    built = build_setup(str(c), block_tokens=reader.block_tokens)
    sim = Simulation(list(reader), built.setup, Load("timestamps", 1.0),
                     block_tokens=built.block_tokens, router=built.make_router(),
                     trace_block_tokens=reader.block_tokens)
    return sim, sim.run()


def second_round_ttfts(sim: Simulation, n: int) -> list[float]:
    return [s.first_token - s.arrival for s in sim.seqs[n:] if s is not None]


def test_connector_costs_by_hand(tmp_path: Path) -> None:
    """One request loads 8,192 tokens (512 blocks of 16): with lookup 40 ms, chunks of 256
    tokens at 2 ms, its TTFT grows by 40 + 32 × 2 = 104 ms over the same run without."""
    t = trace(tmp_path, n=1)
    base = NODE.format(nic=25) + ENGINE + STORE
    plain, _ = run(tmp_path, base, t)
    conn = ('[connector]\nlookup_ms = 40\nchunk_tokens = 256\nchunk_ms = 2\ngbps = "inf"\n')
    costed, doc = run(tmp_path, base + conn, t)
    (a,), (b,) = second_round_ttfts(plain, 1), second_round_ttfts(costed, 1)
    assert b - a == pytest.approx(0.104, abs=1e-9)
    assert doc["cache"]["connector_wait_s"] == pytest.approx(0.104)
    assert ConnectorSpec(lookup_ms=40, chunk_ms=2).load_s(8192) == pytest.approx(0.104)
    assert ConnectorSpec().load_s(0) == 0.0


def test_connector_ceiling_makes_a_faster_nic_no_faster(tmp_path: Path) -> None:
    """WQS scenario 3: 800 Gb/s gave what 400 Gb/s gave, the framework being the limit."""
    t = trace(tmp_path, n=8)
    out = {}
    for nic in (10, 20):  # below the A100's PCIe (32 GB/s) and the target (100)
        for conn in ("", '[connector]\ngbps = 5\nlookup_ms = 0\n'):
            sim, doc = run(tmp_path, NODE.format(nic=nic) + ENGINE + STORE + conn, t)
            out[(nic, bool(conn))] = sorted(second_round_ttfts(sim, 8))
            if conn:  # every load and store crossed the ceiling's link
                link = doc["links"]["connector/engine0"]
                assert link["down"]["bytes"] == doc["cache"]["bytes_loaded"]["nvme"]
                assert link["up"]["bytes"] == doc["cache"]["bytes_stored"]["nvme"]
    assert out[(20, False)] != out[(10, False)]              # NIC-bound: the NIC matters
    assert out[(20, True)] == out[(10, True)]                # connector-bound: it does not
    assert out[(10, True)][-1] > out[(10, False)][-1]


def test_connector_loads_every_hit_it_finds(tmp_path: Path) -> None:
    """vLLM's connectors load what they report found (``load = "always"``); ``faster``
    keeps kvtool's load-or-recompute choice, which declines a slow store."""
    t = trace(tmp_path, n=2, tokens=1024)
    slow = STORE.replace("read_gbps = 100", "read_gbps = 0.01")
    _, always = run(tmp_path, NODE.format(nic=25) + ENGINE + slow + "[connector]\n", t)
    _, faster = run(tmp_path, NODE.format(nic=25) + ENGINE + slow +
                    '[connector]\nload = "faster"\n', t)
    assert always["cache"]["external_hit_tokens"] == 2 * 1008
    assert faster["cache"]["external_hit_tokens"] == 0
    assert faster["cache"]["declined_external_tokens"] == 2 * 1008


PD = ('pd_transfer = "{how}"\n' + NODE.format(nic=25)
      + ENGINE.replace("tp = 1", 'tp = 1\nrole = "prefill"\nname = "p"')
      + ENGINE.replace("tp = 1", 'tp = 1\nrole = "decode"\nname = "d"') + STORE)


def test_pd_through_the_store_reads_back_what_prefill_wrote(tmp_path: Path) -> None:
    t = trace(tmp_path, n=2, rounds=1)
    direct_sim, direct = run(tmp_path, PD.format(how="direct"), t)
    store_sim, store = run(tmp_path, PD.format(how="store"), t)
    for doc in (direct, store):
        assert doc["serving"]["completed"] == 2 and doc["serving"]["failed"] == 0
    # direct: engine to engine; store: the decode engine loads the prefill engine's blocks
    assert direct["cache"]["pd_transfer_bytes"] > 0 and store["cache"]["pd_transfer_bytes"] == 0
    assert direct["links"]["target/t0"]["up"]["bytes"] == 0
    written = store["cache"]["bytes_stored"]["nvme"]
    # all but each prompt's last block (vLLM computes the last token, so its block)
    assert written > 0 and store["cache"]["bytes_loaded"]["nvme"] == written * 511 // 512
    # the decode engine's read is no prompt hit (nothing was cached before)
    assert store["cache"]["token_hit_ratio"] == direct["cache"]["token_hit_ratio"] == 0.0
    # crossing the store twice (write, then read) is slower than one transfer
    assert sorted(second_round_ttfts(store_sim, 0)) > sorted(second_round_ttfts(direct_sim, 0))


def test_bad_connector_and_pd_transfer_are_one_line(tmp_path: Path) -> None:
    c = tmp_path / "c.toml"
    for body, field in (
            (ENGINE + "[connector]\nlookup_ms = -1\n", "connector.lookup_ms"),
            (ENGINE + '[connector]\nload = "sometimes"\n', "connector.load"),
            (ENGINE + "[connector]\nsize = 3\n", "connector.size"),
            ('pd_transfer = "carrier pigeon"\n' + NODE.format(nic=25) + ENGINE, "pd_transfer"),
            (PD.format(how="store").replace(STORE, ""), "pd_transfer")):
        c.write_text(body if "[[node]]" in body else NODE.format(nic=25) + body)
        with pytest.raises(InputError) as info:
            load_cluster(c)
        assert f"field '{field}'" in str(info.value), str(info.value)


def _steps(sim: Simulation) -> dict[str, list[tuple[float, float]]]:
    """Record every engine's planned steps as (start, end) while ``sim`` runs."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in sim.engines:
        steps = out.setdefault(e.name, [])

        def plan(now: float, _plan=e.plan, _steps=steps) -> float | None:  # type: ignore
            end = _plan(now)
            if end is not None:
                _steps.append((now, end))
            return end
        e.plan = plan  # type: ignore[method-assign]
    return out


@pytest.mark.skipif(compiled.active(), reason="records steps by patching an engine's "
                    "method: a compiled engine is a native class (kvtool.compiled)")
@pytest.mark.parametrize("how", ["direct", "store"])
def test_shared_gpus_step_one_engine_at_a_time(tmp_path: Path, how: str) -> None:
    """WQS ran P and D on one server's cards: with ``share_gpus`` the two engines' steps
    never overlap, they take turns (a decode step waits for the prefill step in progress),
    and every request still finishes; without it their steps overlap."""
    t = trace(tmp_path, n=6, tokens=4096, rounds=1)
    body = PD.format(how=how)
    shared = body.replace('role = "prefill"', 'role = "prefill"\nshare_gpus = "n0"') \
        .replace('role = "decode"', 'role = "decode"\nshare_gpus = "n0"')
    spans = {}
    for label, text in (("apart", body), ("shared", shared)):
        c = tmp_path / "c.toml"
        c.write_text(text)
        reader = read_trace(str(t))
        built = build_setup(str(c), block_tokens=reader.block_tokens)
        sim = Simulation(list(reader), built.setup, Load("timestamps", 1.0),
                         block_tokens=built.block_tokens, router=built.make_router(),
                         trace_block_tokens=reader.block_tokens)
        steps = _steps(sim)
        doc = sim.run()
        assert doc["serving"]["completed"] == 6 and doc["serving"]["failed"] == 0
        p, d = steps["p"], steps["d"]
        overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in p for b0, b1 in d)
        spans[label] = (overlap, doc)
        if label == "shared":
            assert overlap == 0.0
            both = sorted([(s, "p") for s, _ in p] + [(s, "d") for s, _ in d])
            assert any(x[1] != y[1] for x, y in itertools.pairwise(both))  # they alternate
    assert spans["apart"][0] > 0
    # decode steps wait behind prefill steps: the inter-token gaps grow
    itl = {k: v[1]["serving"]["mean_tpot_ms"] for k, v in spans.items()}
    assert itl["shared"] > itl["apart"]


def test_share_gpus_group_needs_one_node_and_tp(tmp_path: Path) -> None:
    c = tmp_path / "c.toml"
    two = NODE.format(nic=25) + NODE.format(nic=25).replace("n0", "n1")
    body = two + ENGINE.replace("tp = 1", 'tp = 1\nshare_gpus = "g"') + \
        ENGINE.replace('node = "n0"', 'node = "n1"').replace("tp = 1", 'tp = 1\nshare_gpus = "g"')
    c.write_text(body)
    with pytest.raises(InputError) as info:
        load_cluster(c)
    assert "field 'engine[1].share_gpus'" in str(info.value) and "one node" in str(info.value)
    # two engines sharing a 1-GPU node fit it (their TP counts once)
    one = NODE.format(nic=25).replace("nic_gbps", "gpus = 1\nnic_gbps") + \
        2 * ENGINE.replace("tp = 1", 'tp = 1\nshare_gpus = "g"')
    c.write_text(one)
    assert [e.share_gpus for e in load_cluster(c).engines] == ["g", "g"]
