"""Independent points of a sweep, run side by side: on a Ray cluster, on local cores, or
one after the other.

``kvtool replay --simulate`` with ``--sweep`` or ``--compare`` runs points that share
nothing but their input (the trace, the cluster files): every (cluster, load) of the
serving model, every configuration of the cache replay. :class:`Fanout` runs
``fn(shared, i)`` for ``i`` in ``range(n)`` and returns the results **in index order**, so
a parallel run's report is the serial run's, byte for byte (each point is deterministic
and sees the same ``shared``).

Where the points run (:func:`choose_fanout`):

* **Ray**, when a Ray cluster is named: ``ray_address`` (``--ray ADDRESS``: the head of a
  ``kvtool cluster up``, ``auto``, or ``local`` to start one for the run), else the
  ``RAY_ADDRESS`` environment variable (Ray's own), else the Ray head of the run's cluster
  file when ``kvtool cluster up`` made that cluster and it is up. ``shared`` goes into
  Ray's object store once; each point is one task. A Ray started for the run (``local``)
  listens on 127.0.0.1 only, is shut down after it, and its session directory removed. A
  Ray already initialised in this process (a test's ``ray.init(num_cpus=2)``) is used as
  it is.
* **Local processes** otherwise (``concurrent.futures.ProcessPoolExecutor``, forked:
  the workers inherit ``shared`` instead of unpickling it), as many as there are points,
  at most ``jobs`` (default: the CPUs this process may use).
* **Serial** with ``jobs=1``, for one point, or on a single CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kvtool.errors import UsageError, param

KINDS = ("serial", "processes", "ray")

PointFn = Callable[[Any, int], Any]

_SHARED: tuple[PointFn, Any] | None = None
"""What a forked worker runs: set in the parent just before the pool forks."""


def _init_worker(fn: PointFn, shared: Any) -> None:
    global _SHARED
    _SHARED = (fn, shared)


def _run_point(i: int) -> Any:
    assert _SHARED is not None, "a fan-out worker started without its points"
    fn, shared = _SHARED
    return fn(shared, i)


def local_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class Fanout(NamedTuple):
    """Where a sweep's points run (module docstring). Invariant: :meth:`map` returns
    ``[fn(shared, 0), ..., fn(shared, n - 1)]`` whatever the kind."""

    kind: str
    workers: int = 1
    """Local processes at most (``processes``); informative for the others."""
    ray_address: str | None = None
    """``ray``: the address to join, ``None`` for a Ray already initialised here."""
    ray_env: tuple[tuple[str, str], ...] = ()
    """``ray``: environment the driver joins under (a kvtool cluster's token)."""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "workers": self.workers, "ray_address": self.ray_address}

    def map(self, fn: PointFn, shared: Any, n: int,
            done: Callable[[int], None] | None = None) -> list[Any]:
        """Run ``fn(shared, i)`` for every ``i < n``; ``done(i)`` as each one finishes
        (in any order); the results in index order. A point's exception is raised here
        (the first one by index), after the others have stopped."""
        if n <= 0:
            return []
        if self.kind == "serial" or n == 1:
            out = []
            for i in range(n):
                out.append(fn(shared, i))
                if done is not None:
                    done(i)
            return out
        if self.kind == "processes":
            return self._processes(fn, shared, n, done)
        return self._ray(fn, shared, n, done)

    def _processes(self, fn: PointFn, shared: Any, n: int,
                   done: Callable[[int], None] | None) -> list[Any]:
        # here, not at the top: a run with one point never fans out (start-up time)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("fork")
        results: list[Any] = [None] * n
        with ProcessPoolExecutor(max_workers=min(self.workers, n), mp_context=ctx,
                                 initializer=_init_worker, initargs=(fn, shared)) as pool:
            futures = {pool.submit(_run_point, i): i for i in range(n)}
            errors: dict[int, BaseException] = {}
            for f in as_completed(futures):
                i = futures[f]
                exc = f.exception()
                if exc is not None:
                    errors[i] = exc
                    for other in futures:
                        other.cancel()
                    continue
                results[i] = f.result()
                if done is not None:
                    done(i)
        if errors:
            raise errors[min(errors)]
        return results

    def _ray(self, fn: PointFn, shared: Any, n: int,
             done: Callable[[int], None] | None) -> list[Any]:
        import logging
        import sys

        joined = sys.modules.get("ray")
        if joined is None or not joined.is_initialized():
            os.environ.update(dict(self.ray_env))  # read when ray is imported
        import ray

        opts = {"log_to_driver": False, "logging_level": logging.ERROR,
                "include_dashboard": False}
        if ray.is_initialized():
            session: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        elif self.ray_address == "local":
            session = local_ray(**opts)
        else:
            session = _joined_ray(self.ray_address, **opts)
        with session:
            task = ray.remote(num_cpus=1, max_retries=0)(_ray_point)
            ref = ray.put(shared)
            pending = {task.remote(fn, ref, i): i for i in range(n)}
            results: list[Any] = [None] * n
            errors: dict[int, BaseException] = {}
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for r in ready:
                    i = pending.pop(r)
                    try:
                        results[i] = ray.get(r)
                    except ray.exceptions.RayTaskError as exc:
                        errors[i] = exc.as_instanceof_cause()
                        continue
                    if done is not None:
                        done(i)
            if errors:
                raise errors[min(errors)]
            return results


@contextlib.contextmanager
def local_ray(**init: Any) -> Iterator[None]:
    """A Ray started in this process for the block (``--ray local``; the tests' Ray),
    ``ray.init(**init)``, and shut down after it.

    * It runs in Ray's single-machine mode: its node address is 127.0.0.1, and its GCS,
      raylet and workers listen there only (by default they listen on every interface).
      Ray reads the switch when it is imported, here and in the processes ``ray.init``
      starts, which inherit it. It is set for the start only, so that a multi-node Ray
      joined later in this process is not refused. The module constant (private to Ray,
      its only handle on the mode) covers a ray imported earlier here.
    * Its session (logs, sockets, spilled objects) is kept in a directory of the block's,
      removed after it: Ray's default, ``$TMPDIR/ray``, outlives the run. Ray's Unix
      sockets live there, so ``$TMPDIR`` must be short (a socket's path has at most 107
      bytes; ``/tmp`` is).
    """
    import tempfile

    import ray
    import ray._private.ray_constants as constants

    name = constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    with tempfile.TemporaryDirectory(prefix="kvtool-ray-", ignore_cleanup_errors=True) as temp:
        old, was = os.environ.get(name), constants.ENABLE_RAY_CLUSTER
        os.environ[name] = "0"
        constants.ENABLE_RAY_CLUSTER = False
        try:
            ray.init(address="local", _temp_dir=temp, **init)
        finally:
            constants.ENABLE_RAY_CLUSTER = was
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def _joined_ray(address: str | None, **init: Any) -> Iterator[None]:
    """Ray joined at ``address`` for the block, and left after it."""
    import ray

    ray.init(address=address, **init)
    try:
        yield
    finally:
        ray.shutdown()


def _ray_point(fn: PointFn, shared: Any, i: int) -> Any:
    return fn(shared, i)


ClusterRay = Callable[[], "tuple[str | None, tuple[tuple[str, str], ...]]"]
"""Gives the Ray head of the run's cluster when ``kvtool cluster up`` made it and it is up,
with the environment to join it under (its token), else ``(None, ())``: the caller passes
:func:`kvtool.cluster.state.ray_head_of` (this module sits below :mod:`kvtool.cluster`)."""


def ray_from_env() -> str | None:
    """Ray's ``RAY_ADDRESS``, when set."""
    return os.environ.get("RAY_ADDRESS") or None


def choose_fanout(points: int, *, jobs: int | None = None, ray_address: str | None = None,
                  cluster_ray: ClusterRay | None = None) -> Fanout:
    """Where ``points`` independent points run (module docstring). ``jobs``: local
    processes at most (1: serial); ``ray_address``: a Ray cluster to use (``auto`` or
    ``HOST:PORT``; ``local`` starts one here for the run), else ``RAY_ADDRESS``, else
    ``cluster_ray()``: the Ray head of the run's cluster when it is up."""
    if jobs is not None and jobs < 1:
        raise UsageError(f"{param('jobs')} must be at least 1, got {jobs}", field="jobs")
    if jobs == 1 or points <= 1:
        return Fanout("serial")
    address: str | None = ray_address or ray_from_env()
    env: tuple[tuple[str, str], ...] = ()
    if address is None and cluster_ray is not None:
        address, env = cluster_ray()
    if address is not None:
        import importlib.util

        # (not imported here: Ray reads a cluster's token settings when it is imported)
        if importlib.util.find_spec("ray") is None:
            raise UsageError(f"Ray cluster {address} named, but Ray is not installed: "
                             "pip install 'kvtool[cluster]'", field="ray")
        return Fanout("ray", workers=points, ray_address=address, ray_env=env)
    cpus = local_cpus()
    workers = min(points, jobs if jobs is not None else cpus)
    if workers <= 1:
        return Fanout("serial")
    return Fanout("processes", workers=workers)


__all__ = ["KINDS", "ClusterRay", "Fanout", "choose_fanout", "local_cpus", "local_ray",
           "ray_from_env"]
