"""``--hostnqn`` / ``--dhchap-secret FILE`` / ``--dhchap-ctrl-secret FILE`` for commands that
take an ``nvme+tcp://`` target.

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


def host_options(f: F) -> F:
    """Add the three options; the command gets ``credentials=`` instead of them."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hostnqn = kwargs.pop("hostnqn", None)
        secret = kwargs.pop("dhchap_secret", None)
        ctrl = kwargs.pop("dhchap_ctrl_secret", None)
        target = kwargs.get("target") or kwargs.get("address")
        kwargs["credentials"] = credentials(hostnqn, secret, ctrl, target)
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
    )):
        wrapper = decorator(wrapper)
    return wrapper  # type: ignore[return-value]


def credentials(hostnqn: str | None, secret_file: str | None, ctrl_file: str | None,
                target: str | None) -> HostCredentials | None:
    """Validate and load; UsageError (exit 2, one line, no key material) when unusable."""
    if hostnqn is None and secret_file is None and ctrl_file is None:
        return None
    if target is not None and not target.startswith(NVME_TCP_SCHEME) and ":" not in target:
        given = "--hostnqn" if hostnqn else "--dhchap-secret" if secret_file else \
            "--dhchap-ctrl-secret"
        raise UsageError(f"{target} is not an nvme+tcp:// target; {given} applies to NVMe/TCP "
                         "only", field=given)
    from kvtool.nvme.hostauth import HostCredentials

    return HostCredentials.load(hostnqn, secret_file, ctrl_file,
                                fields=("--hostnqn", "--dhchap-secret", "--dhchap-ctrl-secret"))
