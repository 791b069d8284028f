"""Which data backend moves a serving replay's bytes (:func:`data_backend`): none with
``--simulate``, Ray actors on the nodes of a cluster ``kvtool cluster up`` made
(:mod:`kvtool.replay.raydata`), else this process's own tiers
(:mod:`kvtool.replay.servingdata`). The CLI asks; it does not choose."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtool.errors import UsageError, param
from kvtool.replay.head import cluster_up

if TYPE_CHECKING:
    from kvtool.cluster.state import ClusterState
    from kvtool.nvme.hostauth import HostCredentials


def data_backend(cluster: str, *, simulate: bool, seed: int, faults: Sequence[str] = (),
                 nvme_place: str | None = None, read_qd: int = 32,
                 credentials: HostCredentials | None = None,
                 on_place: Callable[[str], None] | None = None
                 ) -> tuple[Callable[[Any], Any] | None, ClusterState | None]:
    """What moves a serving replay's bytes, and the up cluster it runs on.

    ``(None, None)`` with ``simulate``; Ray actors on the nodes of ``cluster`` when
    ``kvtool cluster up`` made it (:class:`~kvtool.replay.raydata.RayClusterData`, which
    takes ``faults``), else this process's tiers
    (:func:`~kvtool.replay.servingdata.open_cluster_data`). The backend is a function of the
    built cluster (:func:`kvtool.serving.run.run_serving`'s ``backend``); ``on_place``
    hears where each tier is (``"dram tier on …"``)."""
    state = None if simulate else cluster_up(cluster)
    if faults and state is None:
        raise UsageError(f"{param('fault')} needs a cluster that is up (kvtool cluster up "
                         f"{cluster}) and data mode", field="fault")
    if simulate:
        return None, None

    def placed(data: Any) -> Any:
        for tier, place in data.places.items():
            if on_place is not None:
                on_place(f"{tier} tier on {place}")
        return data

    if state is not None:
        from kvtool.replay.faults import Fault
        from kvtool.replay.raydata import RayClusterData

        parsed = [Fault.parse(f) for f in faults]
        up = state
        return (lambda built: placed(RayClusterData(built, up, seed=seed, faults=parsed)),
                state)
    from kvtool.replay.servingdata import open_cluster_data

    return (lambda built: placed(open_cluster_data(built, seed=seed, nvme_place=nvme_place,
                                                   read_qd=read_qd, credentials=credentials)),
            None)
