"""The collapse (cliff) round: one rule for measured replays and predicted plans.

docs/definitions.md: the first round r ≥ 3 whose token hit ratio is at least 25 %
lower (relative) than round r−1's; ``None`` when there is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # (fractions is imported by the callers that pass them: not at start-up)
    from fractions import Fraction

FIRST_ROUND = 3
DROP = (1, 4)
"""A round whose hit ratio is at least this much (relative) below the previous one's, as
numerator and denominator (1/4: exact with ints and fractions alike)."""

Number: TypeAlias = "int | Fraction"


def collapse_round(ratios: Mapping[int, tuple[Number, Number]]) -> int | None:
    """The collapse round from ``{round: (hit_tokens, input_tokens)}``.

    Compared exactly (integers or fractions, never floats, so replay and plan cannot
    disagree at the boundary): ``hit_r / in_r <= (1 − DROP) · hit_{r−1} / in_{r−1}``,
    for a previous round with a positive hit ratio. Pass a float ratio ``x`` as
    ``(Fraction(x), 1)``.
    """
    for r in sorted(ratios):
        if r < FIRST_ROUND or (r - 1) not in ratios:
            continue
        hit, inp = ratios[r]
        prev_hit, prev_inp = ratios[r - 1]
        if prev_hit <= 0 or prev_inp <= 0 or inp <= 0:
            continue
        if DROP[1] * hit * prev_inp <= (DROP[1] - DROP[0]) * prev_hit * inp:
            return r
    return None
