"""A real local Ray for the multi-node tests: ``ray.init(num_cpus=2)`` on 127.0.0.1, once
per test session, shut down afterwards (CI has two cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="the cluster extra (ray) is not installed")
    # Ray's workers are processes of their own: they find this checkout's kvtool through
    # PYTHONPATH, inherited from the driver.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="error", _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
