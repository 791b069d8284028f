"""Run a Ray driver of a cluster on its head node (where the router runs).

A driver in the root namespace can join a netns cluster too (``connect`` with the
cluster's token), but its traffic then bypasses every shaped link; :func:`run_on_head`
runs a job in a fresh Python inside the head's namespace, so the driver's traffic goes
over the head's link like a real head's, and hands back its JSON result. A job is a
function ``name(state, payload) -> dict`` in :data:`JOBS` (module path and function name):
JSON in on stdin, one JSON document out on stdout.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from typing import Any

from kvtool.cluster.errors import ClusterError
from kvtool.cluster.netns import exec_argv
from kvtool.cluster.state import ClusterState, load_state

JOBS: dict[str, tuple[str, str]] = {
    "bench": ("kvtool.cluster.bench", "run_job"),
}
RESULT_MARK = "KVTOOL-JOB-RESULT "


def run_on_head(state: ClusterState, job: str, payload: dict[str, Any], *,
                timeout: float | None = None) -> dict[str, Any]:
    """Run ``job`` with ``payload`` as a driver on ``state``'s head; its result document.

    Its errors come back as the error they were (:class:`kvtool.errors.KvtoolError`
    subclasses keep their exit code); anything else is a :class:`ClusterError`.
    """
    if job not in JOBS:
        raise ClusterError(f"unknown cluster job {job!r}")
    env = {**os.environ, **state.ray_env(), "PYTHONPATH": kvtool_pythonpath()}
    argv = exec_argv(state.head.netns, [sys.executable, "-m", "kvtool.cluster.driver",
                                        str(state.path), job])
    try:
        proc = subprocess.run(argv, input=json.dumps(payload), capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"cluster job {job} on {state.head.name}: no result in "
                           f"{timeout:g} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            doc = json.loads(line[len(RESULT_MARK):])
            if "error" in doc:
                raise _rebuild(doc["error"])
            result: dict[str, Any] = doc["result"]
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise ClusterError(f"cluster job {job} on {state.head.name} exited {proc.returncode} "
                       f"without a result: {' | '.join(tail)}")


def kvtool_pythonpath() -> str:
    """kvtool's own import root first, so the head runs this very kvtool."""
    import kvtool

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvtool.__file__)))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


def _rebuild(err: dict[str, Any]) -> Exception:
    from kvtool import errors

    cls = getattr(errors, err.get("type", ""), None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, errors.KvtoolError)):
        return ClusterError(err.get("message", "cluster job failed"))
    return cls(err.get("message", ""))


def connect(state: ClusterState) -> Any:
    """Join ``state``'s Ray cluster from its head (the process runs there); the module.

    The cluster's Ray settings (its token) go into the environment before Ray is imported:
    Ray reads them then."""
    if not state.ray_address:
        raise ClusterError(f"cluster {state.name} has no Ray head recorded; is it up?")
    os.environ.update(state.ray_env())
    import ray

    try:
        ray.init(address=state.ray_address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:
        raise ClusterError(f"cannot join Ray at {state.ray_address}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no answer'}") from None
    return ray


def node_resource(address: str) -> dict[str, float]:
    """Ray's resource pinning a task to the node with ``address`` (``node:<ip>``)."""
    return {f"node:{address}": 0.001}


def _job(state_file: str, job: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` on the cluster recorded at ``state_file``: ``{"result": …}`` or
    ``{"error": {"type", "message"}}`` (what :func:`run_on_head` rebuilds)."""
    from kvtool.errors import KvtoolError

    try:
        state = load_state(state_file)
        if state is None:
            raise ClusterError(f"no cluster recorded at {state_file}")
        module, fn = JOBS[job]
        result = getattr(importlib.import_module(module), fn)(state, payload)
        doc: dict[str, Any] = {"result": result}
    except KvtoolError as exc:
        doc = {"error": {"type": type(exc).__name__, "message": str(exc)}}
    return doc


if __name__ == "__main__":
    # The program, not the library: its one result line on stdout is what run_on_head
    # reads back.
    result_doc = _job(sys.argv[1], sys.argv[2], json.loads(sys.stdin.read() or "{}"))
    print(RESULT_MARK + json.dumps(result_doc), flush=True)
