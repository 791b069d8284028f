"""``--hostnqn`` / ``--dhchap-secret FILE`` / ``--dhchap-ctrl-secret FILE`` / ``--host`` for
commands that take an ``nvme+tcp://`` or ``nvme+rdma://`` target.

``--host kernel`` connects through the Linux kernel's NVMe-oF host (``/dev/nvme-fabrics``,
then O_DIRECT on the block device) instead of kvtool's userspace NVMe/TCP host; an
``nvme+rdma://`` target always does.

Secrets come from files only (mode 0600), never from the command line, so they do not show
in argv, shell history or ``ps``. The wrapped command receives ``credentials`` (a
:class:`kvtool.nvme.hostauth.HostCredentials`, or None when no option was given).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvtool.errors import UsageError

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

F = TypeVar("F", bound=Callable[..., Any])
NVME_TCP_SCHEME = "nvme+tcp://"
NVME_SCHEMES = ("nvme+tcp://", "nvme+rdma://")


def host_options(f: F) -> F:
    """Add the three options; the command gets ``credentials=`` instead of them."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hostnqn = kwargs.pop("hostnqn", None)
        secret = kwargs.pop("dhchap_secret", None)
        ctrl = kwargs.pop("dhchap_ctrl_secret", None)
        initiator = kwargs.pop("host", None)
        target = kwargs.get("target") or kwargs.get("address")
        kwargs["credentials"] = credentials(hostnqn, secret, ctrl, target, initiator)
        return f(*args, **kwargs)

    for decorator in reversed((
        click.option("--hostnqn", metavar="NQN",
                     help="Host NQN to present (default: the URL's ?hostnqn=, else this machine's)."),
        click.option("--dhchap-secret", type=click.Path(dir_okay=False), metavar="FILE",
                     help="DH-HMAC-CHAP: this host's secret (a DHHC-1 key file, mode 0600; "
                          "kvtool target keygen writes one)."),
        click.option("--dhchap-ctrl-secret", type=click.Path(dir_okay=False), metavar="FILE",
                     help="DH-HMAC-CHAP: the controller's secret; the host then verifies the "
                          "controller too (bidirectional)."),
        click.option("--host", type=click.Choice(["kvtool", "kernel"]), default=None,
                     help="NVMe-oF host: kvtool's userspace NVMe/TCP host (default) or the "
                          "Linux kernel's (nvme+rdma:// always uses the kernel's)."),
    )):
        wrapper = decorator(wrapper)
    return wrapper  # type: ignore[return-value]


def credentials(hostnqn: str | None, secret_file: str | None, ctrl_file: str | None,
                target: str | None, initiator: str | None = None) -> HostCredentials | None:
    """Validate and load; UsageError (exit 2, one line, no key material) when unusable."""
    if hostnqn is None and secret_file is None and ctrl_file is None and initiator is None:
        return None
    if target is not None and not target.startswith(NVME_SCHEMES) and ":" not in target:
        given = "--hostnqn" if hostnqn else "--dhchap-secret" if secret_file else \
            "--dhchap-ctrl-secret" if ctrl_file else "--host"
        raise UsageError(f"{target} is not an nvme+tcp:// or nvme+rdma:// target; {given} "
                         "applies to NVMe-oF only", field=given)
    if initiator == "kvtool" and target is not None and target.startswith("nvme+rdma://"):
        raise UsageError(f"{target}: kvtool's own host speaks NVMe/TCP only; nvme+rdma:// "
                         "uses the kernel's host (--host kernel)", field="--host")
    from kvtool.nvme.hostauth import HostCredentials

    return HostCredentials.load(hostnqn, secret_file, ctrl_file,
                                fields=("--hostnqn", "--dhchap-secret", "--dhchap-ctrl-secret"),
                                initiator=initiator)
