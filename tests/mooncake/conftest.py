"""A real Mooncake Store pool (mooncake_master + metadata server) on 127.0.0.1, free ports,
a private state directory; stopped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    from kvtool.mooncake import pool as P

    mp = pytest.MonkeyPatch()
    state = tmp_path_factory.mktemp("pool-state")
    mp.setenv("KVTOOL_STATE_DIR", str(state))
    ports = [free_port() for _ in range(3)]
    while len(set(ports)) < 3:
        ports = [free_port() for _ in range(3)]
    doc = P.up("t", rpc_port=ports[0], metadata_port=ports[1], metrics_port=ports[2])
    try:
        yield {**doc, "state": Path(state), "ports": ports}
    finally:
        P.down("t")
        mp.undo()
