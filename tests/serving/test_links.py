"""FlowNetwork: max-min fair sharing of per-direction links, computed by hand and by property."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.serving.links import FlowNetwork

GB = 1e9


def _run(net: FlowNetwork) -> None:
    while (t := net.next_completion()) is not None:
        net.advance(t)


def _net(**links: float) -> FlowNetwork:
    net = FlowNetwork()
    for name, gbps in links.items():
        net.add_link(name, up_gbps=gbps, down_gbps=gbps)
    return net


def test_two_flows_on_one_link_each_get_half() -> None:
    net = _net(pcie=10)
    done: list[tuple[str, float]] = []
    a = net.start(0.0, 1 * GB, [("pcie", "down")], lambda t: done.append(("a", t)))
    b = net.start(0.0, 3 * GB, [("pcie", "down")], lambda t: done.append(("b", t)))
    assert net.rate(a) == net.rate(b) == 5 * GB
    # a: 1 GB at 5 GB/s -> t = 0.2; b then has 3 - 1 = 2 GB left at 10 GB/s -> t = 0.4.
    assert net.next_completion() == pytest.approx(0.2)
    _run(net)
    assert [n for n, _ in done] == ["a", "b"]
    assert done[0][1] == pytest.approx(0.2)
    assert done[1][1] == pytest.approx(0.4)
    assert net.rate(b) == 0.0 and b.end_time == pytest.approx(0.4)


def test_a_later_flow_slows_the_first_one_down() -> None:
    net = _net(nic=1)
    a = net.start(0.0, 2 * GB, [("nic", "up")])
    net.advance(1.0)  # a has 1 GB left
    b = net.start(1.0, 0.25 * GB, [("nic", "up")])
    # both at 0.5 GB/s: b done at 1.5; a then has 0.75 GB left at 1 GB/s -> 2.25.
    _run(net)
    assert b.end_time == pytest.approx(1.5)
    assert a.end_time == pytest.approx(2.25)


def test_classic_max_min_example() -> None:
    """L1 = 10 GB/s carries A and B; L2 = 6 GB/s carries B, C and D.

    Progressive filling: every rate rises together; L2 fills first at 6/3 = 2 GB/s, which
    freezes B, C and D at 2. A alone keeps rising on L1 up to 10 - 2 = 8 GB/s.
    """
    net = _net(l1=10, l2=6)
    a = net.start(0, 100 * GB, [("l1", "up")])
    b = net.start(0, 100 * GB, [("l1", "up"), ("l2", "up")])
    c = net.start(0, 100 * GB, [("l2", "up")])
    d = net.start(0, 100 * GB, [("l2", "up")])
    assert net.rate(a) == pytest.approx(8 * GB)
    for f in (b, c, d):
        assert net.rate(f) == pytest.approx(2 * GB)


def test_bottleneck_elsewhere_leaves_the_rest_to_others() -> None:
    """X crosses a slow 1 GB/s link, so on the shared 10 GB/s link Y gets the other 9."""
    net = _net(shared=10, slow=1)
    x = net.start(0, 1 * GB, [("shared", "down"), ("slow", "down")])
    y = net.start(0, 9 * GB, [("shared", "down")])
    assert net.rate(x) == pytest.approx(1 * GB)
    assert net.rate(y) == pytest.approx(9 * GB)
    _run(net)
    assert x.end_time == pytest.approx(1.0)
    assert y.end_time == pytest.approx(1.0)


def test_directions_are_independent() -> None:
    net = FlowNetwork()
    net.add_link("nic", up_gbps=2, down_gbps=8)
    up = net.start(0, 2 * GB, [("nic", "up")])
    down = net.start(0, 8 * GB, [("nic", "down")])
    assert net.rate(up) == pytest.approx(2 * GB)
    assert net.rate(down) == pytest.approx(8 * GB)
    _run(net)
    assert up.end_time == pytest.approx(1.0) and down.end_time == pytest.approx(1.0)
    s = net.stats()["nic"]
    assert s["up"]["bytes"] == pytest.approx(2 * GB) and s["down"]["bytes"] == pytest.approx(8 * GB)


def test_unlimited_links_and_zero_byte_flows_finish_at_their_start() -> None:
    net = FlowNetwork()
    net.add_link("free")
    net.add_link("pcie", up_gbps=1, down_gbps=1)
    calls: list[float] = []
    net.advance(5.0)
    z = net.start(5.0, 0, [("pcie", "up")], calls.append)
    f = net.start(5.0, 10 * GB, [("free", "up")], calls.append)
    assert calls == []  # never inside start()
    assert net.next_completion() == 5.0
    assert net.advance(5.0) == 2
    assert calls == [5.0, 5.0] and z.end_time == 5.0 and f.end_time == 5.0
    # an unlimited hop does not limit a flow that also crosses a limited one
    g = net.start(5.0, 1 * GB, [("free", "down"), ("pcie", "down")])
    assert net.rate(g) == pytest.approx(1 * GB)


def test_stats_busy_time_bytes_and_peak() -> None:
    net = _net(nic=1)
    net.start(0, 1 * GB, [("nic", "up")])
    net.start(0, 1 * GB, [("nic", "up")])
    _run(net)  # both done at 2.0
    net.advance(3.0)
    net.start(3.0, 0.5 * GB, [("nic", "up")])
    net.advance(3.25)  # halfway: stats count bytes in flight up to now
    mid = net.stats()["nic"]["up"]
    assert mid["bytes"] == pytest.approx(2.25 * GB)
    assert mid["busy_s"] == pytest.approx(2.25)
    _run(net)
    s = net.stats()["nic"]["up"]
    assert s["bytes"] == pytest.approx(2.5 * GB)
    assert s["busy_s"] == pytest.approx(2.5)  # idle from 2.0 to 3.0 is not busy
    assert s["peak_flows"] == 2


def test_callbacks_may_start_flows_and_ties_complete_in_start_order() -> None:
    net = _net(a=1, b=1)
    order: list[str] = []

    def chained(t: float) -> None:
        order.append("first")
        net.start(t, 1 * GB, [("b", "up")], lambda t2: order.append(f"second@{t2:g}"))

    net.start(0, 1 * GB, [("a", "up")], chained)
    net.start(0, 1 * GB, [("b", "down")], lambda t: order.append("tie"))
    net.advance(10.0)
    assert order == ["first", "tie", "second@2"]
    assert net.now == 10.0


def test_bad_use_is_refused() -> None:
    net = _net(a=1)
    with pytest.raises(ValueError, match="unknown link"):
        net.start(0, 1, [("b", "up")])
    with pytest.raises(ValueError, match="direction"):
        net.start(0, 1, [("a", "sideways")])
    with pytest.raises(ValueError, match="twice"):
        net.start(0, 1, [("a", "up"), ("a", "up")])
    with pytest.raises(ValueError, match=">= 0"):
        net.start(0, -1, [("a", "up")])
    with pytest.raises(ValueError, match="> 0"):
        net.add_link("z", up_gbps=0)
    net.advance(2.0)
    with pytest.raises(ValueError, match="back in time"):
        net.advance(1.0)


def test_more_bandwidth_can_slow_another_flow_under_max_min() -> None:
    """Why the monotonicity property below is stated per link or for uniform scaling only.

    A crosses L1 (0.5 GB/s) and L2 (2 GB/s); B crosses L2 only. Rates: A 0.5, B 1.5. Raise
    L1 to 1 GB/s and A takes its fair half of L2: A 1, B 1 — B finishes later. Max-min
    fairness is monotone for the leximin order of the rates, not flow by flow.
    """
    def rates(l1: float) -> tuple[float, float]:
        net = FlowNetwork()
        net.add_link("l1", l1, l1)
        net.add_link("l2", 2, 2)
        a = net.start(0, GB, [("l1", "up"), ("l2", "up")])
        b = net.start(0, GB, [("l2", "up")])
        return net.rate(a) / GB, net.rate(b) / GB

    assert rates(0.5) == pytest.approx((0.5, 1.5))
    assert rates(1.0) == pytest.approx((1.0, 1.0))


# -- properties --------------------------------------------------------------------------------

LINKS = ("l0", "l1", "l2", "l3")
_hop = st.tuples(st.sampled_from(LINKS), st.sampled_from(("up", "down")))
_flow = st.tuples(
    st.floats(0, 10, allow_nan=False),                                   # start time (s)
    st.one_of(st.just(0.0), st.floats(1e3, 1e10, allow_nan=False)),      # bytes
    st.lists(_hop, min_size=1, max_size=3, unique=True),                 # path
)
_caps = st.lists(st.one_of(st.floats(0.1, 100, allow_nan=False), st.just(math.inf)),
                 min_size=len(LINKS), max_size=len(LINKS))


def _simulate(caps: list[float], flows: list[tuple[float, float, list[tuple[str, str]]]]
              ) -> tuple[FlowNetwork, list[float]]:
    net = FlowNetwork()
    for name, c in zip(LINKS, caps, strict=True):
        net.add_link(name, up_gbps=c, down_gbps=c)
    ends = [math.nan] * len(flows)
    order = sorted(range(len(flows)), key=lambda i: flows[i][0])
    def recorder(i: int) -> Callable[[float], None]:
        return lambda t: ends.__setitem__(i, t)

    for i in order:
        start, nbytes, path = flows[i]
        net.advance(start)
        net.start(start, nbytes, path, recorder(i))
    _run(net)
    return net, ends


@settings(max_examples=60, deadline=None)
@given(_caps, st.lists(_flow, min_size=1, max_size=12))
def test_conservation(caps: list[float], flows: list[tuple[float, float, list[tuple[str, str]]]]
                      ) -> None:
    net, ends = _simulate(caps, flows)
    assert not any(math.isnan(e) for e in ends)
    assert all(e >= f[0] for e, f in zip(ends, flows, strict=True))
    assert net.delivered_bytes == pytest.approx(net.started_bytes)
    assert net.active_flows == 0
    stats = net.stats()
    for name in LINKS:
        for d in ("up", "down"):
            expected = sum(f[1] for f in flows if (name, d) in f[2])
            assert stats[name][d]["bytes"] == pytest.approx(expected, rel=1e-6, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(_caps, st.lists(st.lists(_hop, min_size=1, max_size=3, unique=True), min_size=1,
                       max_size=10))
def test_rates_are_max_min_fair(caps: list[float], paths: list[list[tuple[str, str]]]) -> None:
    """Feasible, and every flow has a bottleneck: a full hop where no flow gets more."""
    net = FlowNetwork()
    for name, c in zip(LINKS, caps, strict=True):
        net.add_link(name, up_gbps=c, down_gbps=c)
    flows = [net.start(0, GB, p) for p in paths]
    rate = {f.id: net.rate(f) for f in flows}
    load: dict[tuple[str, str], float] = {}
    for f in flows:
        for h in f.path:
            load[h] = load.get(h, 0.0) + rate[f.id]
    for (name, _), used in load.items():
        assert used <= caps[LINKS.index(name)] * GB * (1 + 1e-9)
    for f in flows:
        if math.isinf(rate[f.id]):
            assert all(math.isinf(caps[LINKS.index(n)]) for n, _ in f.path)
            continue
        assert any(
            load[h] >= caps[LINKS.index(h[0])] * GB * (1 - 1e-9)
            and all(rate[g.id] <= rate[f.id] * (1 + 1e-9) for g in flows if h in g.path)
            for h in f.path)


@settings(max_examples=60, deadline=None)
@given(_caps, st.lists(st.lists(_hop, min_size=1, max_size=3, unique=True), min_size=1,
                       max_size=10), st.integers(0, len(LINKS) - 1), st.floats(1, 10))
def test_more_bandwidth_never_lowers_the_leximin_rates(
        caps: list[float], paths: list[list[tuple[str, str]]], link: int, factor: float) -> None:
    """Max-min fair rates are the leximin-largest feasible ones, so growing a link (which
    only enlarges the feasible set) never makes the sorted rate vector smaller."""
    def sorted_rates(cs: list[float]) -> list[float]:
        net = FlowNetwork()
        for name, c in zip(LINKS, cs, strict=True):
            net.add_link(name, up_gbps=c, down_gbps=c)
        flows = [net.start(0, GB, p) for p in paths]
        return sorted(net.rate(f) for f in flows)

    before = sorted_rates(caps)
    bigger = list(caps)
    bigger[link] *= factor
    after = sorted_rates(bigger)
    for b, a in zip(before, after, strict=True):
        if not math.isclose(a, b, rel_tol=1e-9):
            assert a > b
            break


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 100), st.floats(1, 10), st.lists(
    st.tuples(st.floats(0, 10), st.floats(1e3, 1e10)), min_size=1, max_size=12))
def test_more_bandwidth_on_a_shared_link_never_finishes_a_flow_later(
        gbps: float, factor: float, flows: list[tuple[float, float]]) -> None:
    """One link shared by flows arriving over time (processor sharing): a faster link
    never finishes any flow later."""
    spec = [(t, n, [("l0", "up")]) for t, n in flows]
    _, slow = _simulate([gbps, 1, 1, 1], spec)
    _, fast = _simulate([gbps * factor, 1, 1, 1], spec)
    for s, f in zip(slow, fast, strict=True):
        assert f <= s * (1 + 1e-9) + 1e-9


@settings(max_examples=60, deadline=None)
@given(_caps, st.lists(_flow, min_size=1, max_size=12), st.floats(1, 10))
def test_scaling_every_link_up_never_finishes_a_flow_later(
        caps: list[float], flows: list[tuple[float, float, list[tuple[str, str]]]],
        factor: float) -> None:
    _, slow = _simulate(caps, flows)
    _, fast = _simulate([c * factor for c in caps], flows)
    for s, f in zip(slow, fast, strict=True):
        assert f <= s * (1 + 1e-9) + 1e-9
