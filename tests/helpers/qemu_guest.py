"""pytest fixtures for the real Linux kernel in a QEMU guest (loaded from tests/conftest.py).

* ``guest_image`` (session): the built kernel + initramfs (``emulator.qemu.ensure_built``;
  ``$KVTOOL_GUEST_KERNEL``: 6.1, the default, or 6.12);
  ``guest_image_612``: the same with bookworm-backports' 6.12 kernel (NVMe authentication).
  Skips with the reason when it cannot be built here (not root, apt unreachable); under CI
  (``$CI`` set) that is a failure instead, since CI has everything it needs.
* ``kernel_target`` (module): a running guest whose kernel serves an nvmet-tcp target on a
  127.0.0.1 port: a ``KernelTarget`` (host, port, subnqn, nsid, size, lba_size, guest).
  A test module may override ``kernel_target_options`` to pass more ``Guest`` options.
* ``make_guest`` (function): factory ``make_guest(**Guest options) -> Guest`` (started and
  ready); every guest it made is stopped at the end of the test.

Tests that use any of these are marked ``qemu``, ``integration`` and ``slow`` automatically.
At most ``MAX_GUESTS`` (2, one per CPU of the CI machine) guests run at once in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from emulator.qemu.build import BuildError, GuestImage, ensure_built, guest_hostnqn
from emulator.qemu.guest import DEFAULT_NQN, Guest

MAX_GUESTS = 2
QEMU_FIXTURES = {"guest_image", "guest_image_612", "kernel_target", "make_guest"}
_live: list[Guest] = []

MakeGuest = Callable[..., Guest]


@dataclass(frozen=True)
class KernelTarget:
    """Where the guest kernel's nvmet-tcp target answers, as seen from the host."""

    host: str
    port: int
    subnqn: str
    nsid: int
    size: int
    lba_size: int
    guest: Guest

    @property
    def url(self) -> str:
        return f"nvme+tcp://{self.host}:{self.port}/{self.subnqn}/{self.nsid}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if QEMU_FIXTURES & set(getattr(item, "fixturenames", ())):
            for name in ("qemu", "integration", "slow"):
                item.add_marker(name)


def _start(guest: Guest) -> Guest:
    alive = [g for g in _live if g.running]
    _live[:] = alive
    if len(alive) >= MAX_GUESTS:
        raise RuntimeError(f"at most {MAX_GUESTS} QEMU guests at once (2 CPUs); stop one first")
    _live.append(guest)
    try:
        guest.start()
    except BaseException:
        _live.remove(guest)
        raise
    return guest


# The guest tests run on either kernel: KVTOOL_GUEST_KERNEL=6.12 runs them on backports' 6.12
# (the authentication tests always use 6.12, through ``guest_image_612``).
GUEST_KERNEL = os.environ.get("KVTOOL_GUEST_KERNEL", "6.1")
GUEST_HOSTNQN = guest_hostnqn(GUEST_KERNEL)  # what the guest's nvme-cli presents


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    try:
        return ensure_built(kernel=GUEST_KERNEL)
    except BuildError as e:
        if os.environ.get("CI"):
            pytest.fail(f"QEMU guest image cannot be built in CI: {e}")
        pytest.skip(f"QEMU guest image cannot be built here: {e}")


@pytest.fixture(scope="session")
def guest_image_612() -> GuestImage:
    """The bookworm-backports 6.12 guest (NVMe DH-HMAC-CHAP on both kernel sides)."""
    try:
        return ensure_built(kernel="6.12")
    except BuildError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the 6.12 QEMU guest image cannot be built in CI: {e}")
        pytest.skip(f"the 6.12 QEMU guest image cannot be built here: {e}")


def start_guest(guest: Guest) -> Guest:
    """Start ``guest`` under the same at-most-two-guests rule as the fixtures."""
    return _start(guest)


@pytest.fixture(scope="module")
def kernel_target_options() -> dict[str, Any]:
    """Extra ``Guest`` options for ``kernel_target``; override in a test module to add some
    (e.g. ``guest_forwards``). ``target``, ``nqn`` and ``size_mb`` are fixed."""
    return {}


@pytest.fixture(scope="module")
def kernel_target(
    guest_image: GuestImage, kernel_target_options: dict[str, Any]
) -> Iterator[KernelTarget]:
    size_mb = 64
    guest = _start(Guest(guest_image, target=True, nqn=DEFAULT_NQN, size_mb=size_mb,
                         **kernel_target_options))
    try:
        yield KernelTarget("127.0.0.1", guest.target_port, DEFAULT_NQN, 1,
                           size_mb * 1024 * 1024, 512, guest)
    finally:
        guest.stop()


@pytest.fixture
def make_guest(guest_image: GuestImage) -> Iterator[MakeGuest]:
    made: list[Guest] = []

    def make(**options: Any) -> Guest:
        guest = Guest(guest_image, **options)
        made.append(guest)
        return _start(guest)

    try:
        yield make
    finally:
        for guest in made:
            guest.stop()
