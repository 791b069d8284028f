"""pytest fixtures for SPDK built from ../shared/vendor/spdk (loaded from tests/conftest.py).

* ``spdk`` (session): an ``SpdkInstall``: ``$KVTOOL_SPDK_DIR``, else the cached build under
  /var/tmp/kvtool-spdk, built on first use (minutes, once per machine). Skips with the reason
  only when SPDK's sources are absent (../shared/vendor/spdk) and no KVTOOL_SPDK_DIR is set;
  a failed build fails the test.
* ``spdk_app`` (function): factory ``spdk_app(binary="nvmf_tgt", **SpdkApp options) ->
  SpdkApp``, started (no hugepages, core 0x1, private RPC socket, ``.rpc(method, params)``);
  every app it started is stopped at the end of the test.
* ``nvmf_tgt`` (function): a started ``nvmf_tgt`` with the TCP transport created.

Tests that use any of these are marked ``spdk``, ``integration`` and ``slow``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import BUILD_SCRIPT, VENDOR, SpdkInstall, SpdkNotFound, find_spdk

SPDK_FIXTURES = {"spdk", "spdk_app", "nvmf_tgt"}

MakeApp = Callable[..., SpdkApp]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SPDK_FIXTURES & set(getattr(item, "fixturenames", ())):
            for name in ("spdk", "integration", "slow"):
                item.add_marker(name)


@pytest.fixture(scope="session")
def spdk() -> SpdkInstall:
    try:
        return find_spdk(build=True, log=print)
    except SpdkNotFound as exc:
        if not (VENDOR.is_dir() and BUILD_SCRIPT.is_file()):
            pytest.skip(str(exc))
        pytest.fail(f"SPDK cannot be built: {exc}")


@pytest.fixture
def spdk_app(spdk: SpdkInstall) -> Iterator[MakeApp]:
    started: list[SpdkApp] = []

    def make(binary: str = "nvmf_tgt", **options: Any) -> SpdkApp:
        app = SpdkApp(spdk, binary, die_with_parent=True, **options)
        started.append(app)
        return app.start()

    try:
        yield make
    finally:
        for app in started:
            app.stop()


@pytest.fixture
def nvmf_tgt(spdk_app: MakeApp) -> SpdkApp:
    app = spdk_app("nvmf_tgt")
    app.rpc("nvmf_create_transport", {"trtype": "TCP"})
    return app
