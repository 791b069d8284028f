"""The error a cluster operation raises when the system refuses it (exit 1)."""

from __future__ import annotations

from kvtool.errors import KvtoolError


class ClusterError(KvtoolError):
    """A step of ``cluster up``/``down`` failed (a command refused, a process died, a
    namespace could not be removed). Not an input mistake: exit 1."""

    exit_code = 1
