"""Mooncake Store as kvtool's DRAM tier: the ``mooncake://`` URL, the loopback pool
(``kvtool pool``), and a client that stores KV blocks in it (extra ``kvtool[mooncake]``)."""

from kvtool.mooncake.url import MooncakeUrl, parse_mooncake_url

__all__ = ["MooncakeUrl", "parse_mooncake_url"]
