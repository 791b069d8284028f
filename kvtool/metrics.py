"""Prometheus metrics for long runs (``--metrics-port`` on ``replay`` and ``experiment run``).

Served on ``127.0.0.1:PORT/metrics`` by ``prometheus_client`` from a registry of our own
(not the library's global one, so two runs in one process never share counters). Names
follow the client's conventions (``_total`` counters, base units)::

    kvtool_requests_total{config}                      requests served
    kvtool_input_tokens_total{config}
    kvtool_recompute_tokens_total{config}
    kvtool_hit_tokens_total{config,tier}                prefix-hit tokens per tier
    kvtool_hit_bytes_total{config,tier}                 bytes of the hit blocks per tier
    kvtool_puts_total{config,tier}                      computed blocks written into a tier
    kvtool_promotions_total{config,tier}                hit blocks copied up into a tier
    kvtool_blocks_written_total{config,tier}            puts + promotions (+ demotions)
    kvtool_evictions_total{config,tier}
    kvtool_corrupt_blocks_total{config,tier}            blocks that failed their check
    kvtool_request_ttft_seconds{config}                 histogram (modelled or measured)
    kvtool_request_load_seconds{config}                 histogram, data mode: measured time
                                                        loading a request's hit blocks

The emulator's NVMe/TCP target has its own (``emulator.nvmetcp.metrics``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from kvtool.errors import UsageError

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1, 2.5, 5, 10)
"""A request's loads take from microseconds (GPU hits only) to seconds (many NVMe blocks)."""


class ReplayMetrics:
    """Counters fed one request at a time (``request(label, outcome)``)."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 block_bytes: int | None = None, block_tokens: int | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.port: int | None = None
        r = self.registry
        self.requests = Counter("kvtool_requests", "Requests served", ["config"], registry=r)
        self.input_tokens = Counter("kvtool_input_tokens", "Input tokens of served requests",
                                    ["config"], registry=r)
        self.recompute = Counter("kvtool_recompute_tokens", "Input tokens recomputed (missed)",
                                 ["config"], registry=r)
        self.hit_tokens = Counter("kvtool_hit_tokens", "Prefix-hit tokens by serving tier",
                                  ["config", "tier"], registry=r)
        self.hit_bytes = Counter("kvtool_hit_bytes", "Bytes of the hit blocks by serving tier",
                                 ["config", "tier"], registry=r)
        self.puts = Counter("kvtool_puts", "Computed blocks written into a tier",
                            ["config", "tier"], registry=r)
        self.promotions = Counter("kvtool_promotions", "Hit blocks copied up into a tier",
                                  ["config", "tier"], registry=r)
        self.written = Counter("kvtool_blocks_written", "Blocks inserted into a tier (puts, "
                               "promotions, demotions)", ["config", "tier"], registry=r)
        self.evictions = Counter("kvtool_evictions", "Blocks evicted from a tier",
                                 ["config", "tier"], registry=r)
        self.corrupt = Counter("kvtool_corrupt_blocks", "Blocks that failed their content "
                               "check (never served)", ["config", "tier"], registry=r)
        self.ttft = Histogram("kvtool_request_ttft_seconds", "Time to first token per request",
                              ["config"], buckets=TTFT_BUCKETS, registry=r)
        self.load = Histogram("kvtool_request_load_seconds", "Measured time loading a "
                              "request's hit blocks into the GPU pool (data mode)",
                              ["config"], buckets=LOAD_BUCKETS, registry=r)

    def request(self, label: str, o: Any) -> None:
        """Count one request's outcome (:class:`kvtool.cache.RequestOutcome`)."""
        self.requests.labels(label).inc()
        self.input_tokens.labels(label).inc(o.input_tokens)
        self.recompute.labels(label).inc(o.recompute_tokens)
        for tier, n in o.hit_tokens.items():
            if n:
                self.hit_tokens.labels(label, tier).inc(n)
                if self.block_bytes and self.block_tokens:
                    # A hit block is loaded whole even when the prompt ends inside it.
                    blocks = -(-n // self.block_tokens)
                    self.hit_bytes.labels(label, tier).inc(blocks * self.block_bytes)
        for field, counter in (("blocks_written", self.written), ("evictions", self.evictions),
                               ("put_blocks", self.puts), ("promoted_blocks", self.promotions),
                               ("corrupt_blocks", self.corrupt)):
            values = getattr(o, field, None) or {}
            for tier, n in values.items():
                if n:
                    counter.labels(label, tier).inc(n)
        if o.ttft_s == o.ttft_s:  # not NaN: a request the timing engine could not hold
            self.ttft.labels(label).observe(o.ttft_s)
        load_s = getattr(o, "load_s", None)
        if load_s is not None:  # simulate mode models loads: nothing measured to show
            self.load.labels(label).observe(load_s)

    def serve(self, port: int) -> ReplayMetrics:
        self.port = serve_registry(self.registry, port)
        return self


def serve_registry(registry: CollectorRegistry, port: int) -> int:
    """Serve ``registry`` on 127.0.0.1:``port`` (0: any free port) in a daemon thread;
    return the port."""
    try:
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise UsageError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}",
                         field="metrics_port") from None
    return int(server.server_port)


def serve_metrics(port: int) -> ReplayMetrics:
    """A fresh :class:`ReplayMetrics`, served on ``port`` (set ``block_bytes`` and
    ``block_tokens`` once known, for ``kvtool_hit_bytes_total``)."""
    return ReplayMetrics().serve(port)
