"""``mooncake://HOST:PORT[?metadata=HOST:PORT]``: where a Mooncake Store pool is.

``HOST:PORT`` is the master's RPC address; ``metadata`` the HTTP metadata server (the
etcd replacement Mooncake ships), by default on the same host at port 8080, Mooncake's
own default. ``kvtool pool status --json`` prints the URL of the pool it started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtool.errors import UsageError

SCHEME = "mooncake://"
DEFAULT_METADATA_PORT = 8080
_HOSTPORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")


@dataclass(frozen=True)
class MooncakeUrl:
    host: str
    port: int
    metadata_host: str
    metadata_port: int

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.metadata_host}:{self.metadata_port}/metadata"

    def __str__(self) -> str:
        base = f"{SCHEME}{self.host}:{self.port}"
        if self.metadata_host == self.host and self.metadata_port == DEFAULT_METADATA_PORT:
            return base
        return f"{base}?metadata={self.metadata_host}:{self.metadata_port}"


def _hostport(text: str, url: str, field: str) -> tuple[str, int]:
    m = _HOSTPORT.match(text)
    if not m or not 0 < int(m.group("port")) < 65536:
        raise UsageError(f"{url!r}: expected HOST:PORT, got {text!r} "
                         "(example: mooncake://127.0.0.1:50051)", field=field)
    return m.group("host"), int(m.group("port"))


def parse_mooncake_url(url: str, *, field: str = "dram") -> MooncakeUrl:
    if not url.startswith(SCHEME):
        raise UsageError(f"{url!r} is not a {SCHEME} URL", field=field)
    where, _, query = url[len(SCHEME):].partition("?")
    where = where.rstrip("/")
    host, port = _hostport(where, url, field)
    meta_host, meta_port = host, DEFAULT_METADATA_PORT
    if query:
        key, eq, value = query.partition("=")
        if key != "metadata" or not eq:
            raise UsageError(f"{url!r}: the only parameter is metadata=HOST:PORT", field=field)
        meta_host, meta_port = _hostport(value, url, field)
    return MooncakeUrl(host, port, meta_host, meta_port)
