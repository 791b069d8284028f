"""Plans: ordered steps with undo actions, applied all-or-nothing.

A backend compares the desired state with what it reads from the target and returns a
:class:`Plan`. :func:`apply` runs the steps in order; when one fails it runs the ``undo``
of every step that already succeeded, newest first, so the target is left as it was
before the run (docs/target.md: an interrupted ``target up`` leaves no half-built target).
An empty plan means the target already matches the config: ``up`` is then a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtool.errors import KvtoolError


class TargetError(KvtoolError):
    """The target refused an operation (not a config mistake): exit 1."""

    exit_code = 1


class ApplyFailed(TargetError):
    """A step failed; ``rolled_back`` says whether every completed step was undone."""

    def __init__(self, message: str, *, step: Step, index: int, cause: BaseException,
                 rolled_back: bool, rollback_errors: list[str]) -> None:
        self.step = step
        self.index = index
        self.cause = cause
        self.rolled_back = rolled_back
        self.rollback_errors = rollback_errors
        super().__init__(message)


@dataclass
class Step:
    """One change. ``do`` performs it; ``undo`` reverses it (None: nothing to undo)."""

    action: str  # create | update | delete | link | unlink | start | stop | load
    kind: str  # subsystem | namespace | port | host | bdev | transport | listener | process ...
    target: str  # what it acts on (a configfs path, an NQN, a bdev name)
    detail: str
    do: Callable[[], Any] = field(repr=False)
    undo: Callable[[], Any] | None = field(default=None, repr=False)

    def describe(self) -> str:
        return f"{self.action} {self.kind} {self.target}" + (f" ({self.detail})" if self.detail else "")

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "kind": self.kind, "target": self.target,
                "detail": self.detail, "reversible": self.undo is not None}


@dataclass
class Plan:
    backend: str
    operation: str  # "up" | "down"
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, action: str, kind: str, target: str, detail: str, do: Callable[[], Any],
            undo: Callable[[], Any] | None = None) -> None:
        self.steps.append(Step(action, kind, target, detail, do, undo))

    @property
    def empty(self) -> bool:
        return not self.steps

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "operation": self.operation,
                "steps": [s.to_json() for s in self.steps], "notes": list(self.notes)}


def apply(plan: Plan, on_step: Callable[[int, Step], None] | None = None) -> int:
    """Run every step; on failure undo the completed ones and raise :class:`ApplyFailed`.

    Returns the number of steps applied.
    """
    done: list[Step] = []
    for i, step in enumerate(plan.steps):
        if on_step is not None:
            on_step(i, step)
        try:
            step.do()
        except Exception as exc:
            errors = _rollback(done)
            irreversible = [s.describe() for s in done if s.undo is None]
            rolled = not errors and not irreversible
            what = (f"rolled back {len(done)} completed step(s); the target is as it was"
                    if rolled else
                    "rollback incomplete: " + "; ".join(errors + [f"cannot undo: {d}"
                                                                   for d in irreversible]))
            if not done:
                what = "nothing had been changed"
            raise ApplyFailed(f"step {i + 1}/{len(plan.steps)} ({step.describe()}) failed: "
                              f"{_reason(exc)}; {what}", step=step, index=i, cause=exc,
                              rolled_back=rolled or not done, rollback_errors=errors) from exc
        done.append(step)
    return len(done)


def _rollback(done: list[Step]) -> list[str]:
    errors: list[str] = []
    for step in reversed(done):
        if step.undo is None:
            continue
        try:
            step.undo()
        except Exception as exc:  # keep undoing the rest; report every failure
            errors.append(f"undo of {step.describe()} failed: {_reason(exc)}")
    return errors


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KvtoolError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})"
    return f"{type(exc).__name__}: {exc}"
