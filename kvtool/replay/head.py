"""A command relaunched on a cluster's head node: the router and the Ray driver of a netns
cluster run in the head's namespace (:func:`on_head`, :func:`relaunch_on_head`), on a
cluster ``kvtool cluster up`` made (:func:`cluster_up`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtool.cluster.state import ClusterState


ON_HEAD_ENV = "KVTOOL_ON_HEAD"
"""Set (to the cluster's name) in a command relaunched on its head (:func:`on_head`)."""


def on_head(state: ClusterState, args: Sequence[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment that run ``kvtool ARGS`` on ``state``'s head node,
    or ``None`` when this process is there already (a host cluster, or relaunched).

    The router and the driver of a netns cluster run in the head's namespace: a Ray
    driver outside the cluster's namespaces reaches the head, but objects it owns are
    not reachable from the other nodes (a sweep's points, an engine's larger replies),
    and its traffic would bypass every shaped link."""
    import sys

    from kvtool.cluster.driver import kvtool_pythonpath
    from kvtool.cluster.netns import exec_argv

    if state.head.netns is None or os.environ.get(ON_HEAD_ENV) == state.name:
        return None
    env = {**os.environ, **state.ray_env(), ON_HEAD_ENV: state.name,
           "PYTHONPATH": kvtool_pythonpath()}
    return exec_argv(state.head.netns, [sys.executable, "-m", "kvtool", *args]), env


def cluster_up(path: str) -> ClusterState | None:
    """The state of the cluster ``path`` describes when ``kvtool cluster up`` made it and
    it is up, else ``None``."""
    from kvtool.cluster.state import load_state

    state = load_state(path)
    return state if state is not None and state.phase == "up" else None


def relaunch_on_head(cluster: str, args: Sequence[str],
                     on_relaunch: Callable[[ClusterState], None] | None = None) -> int | None:
    """Run ``kvtool ARGS`` on the head of ``cluster`` when it is an up netns cluster and
    this process is not there already (:func:`on_head`): its exit status, its output passed
    through; ``None`` when the command runs here. ``on_relaunch`` hears of it first."""
    import subprocess

    state = cluster_up(cluster)
    if state is None:
        return None
    relaunch = on_head(state, args)
    if relaunch is None:
        return None
    argv, env = relaunch
    if on_relaunch is not None:
        on_relaunch(state)
    return subprocess.run(argv, env=env, check=False).returncode

