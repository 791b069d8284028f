"""The shape of a multi-turn workload, shared by the trace generator and the capacity plan.

A leaf without numpy: ``kvtool plan`` models this shape without generating a trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtool.errors import UsageError


def positive(value: int, field: str) -> None:
    if value <= 0:
        raise UsageError(f"must be positive, got {value}", field=field)


def not_negative(value: int, field: str) -> None:
    if value < 0:
        raise UsageError(f"must not be negative, got {value}", field=field)


@dataclass(frozen=True)
class Sessions:
    """C ``sessions`` × R ``rounds`` of a multi-turn conversation: each round a session
    sends its whole history plus N (``input_tokens``) new tokens and gets M
    (``output_tokens``) answer tokens, which join the next round's prefix; a shared
    system prompt of S tokens comes first. The one shape that the trace generator
    (:class:`~kvtool.trace.gen.MultiTurn`) writes and the capacity plan (:class:`kvtool.plan.Workload`)
    models. Invariant: C, R and ``block_tokens`` are positive, N, M and S non-negative."""

    sessions: int
    rounds: int
    input_tokens: int
    output_tokens: int
    system_prompt_tokens: int = 0
    block_tokens: int = 256

    @staticmethod
    def from_table(table: Mapping[str, Any]) -> Sessions:
        """The shape a table gives (an experiment's multi-turn ``[workload]``, which may
        hold more keys): its values for the fields it names, the defaults for the rest."""
        return Sessions(**{f.name: table[f.name] for f in fields(Sessions) if f.name in table})

    def __post_init__(self) -> None:
        positive(self.sessions, "sessions")
        positive(self.rounds, "rounds")
        positive(self.block_tokens, "block_tokens")
        not_negative(self.input_tokens, "input_tokens")
        not_negative(self.output_tokens, "output_tokens")
        not_negative(self.system_prompt_tokens, "system_prompt_tokens")

    @property
    def delta(self) -> int:
        """Δ = N + M: new tokens per session per round."""
        return self.input_tokens + self.output_tokens

    def input_length(self, round_: int) -> int:
        """Input tokens of every session's round-``round_`` request (1-based): the whole
        history plus N new tokens."""
        return self.system_prompt_tokens + (round_ - 1) * self.delta + self.input_tokens
