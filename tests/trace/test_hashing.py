"""Chained block keys: prefix sharing, change propagation, determinism."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.trace.hashing import TOKEN_MAX, chain_hashes
from tests.conftest import REPO

tokens_st = st.lists(st.integers(0, TOKEN_MAX), max_size=80)
block_st = st.integers(1, 9)


@given(tokens_st, tokens_st, tokens_st, block_st)
def test_shared_prefix_gives_shared_keys(prefix: list[int], a: list[int], b: list[int],
                                         block: int) -> None:
    ka, kb = chain_hashes(prefix + a, block), chain_hashes(prefix + b, block)
    shared = len(prefix) // block
    assert ka[:shared] == kb[:shared]


@given(tokens_st.filter(lambda t: len(t) >= 1), block_st, st.data())
def test_changed_token_changes_its_block_and_all_later(tokens: list[int], block: int,
                                                       data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % (TOKEN_MAX + 1)
    before, after = chain_hashes(tokens, block), chain_hashes(changed, block)
    k = i // block
    assert before[:k] == after[:k]
    # Every full block from the changed one on gets a new key (64-bit: no collisions here).
    assert all(x != y for x, y in zip(before[k:], after[k:], strict=True))


@given(tokens_st, block_st)
def test_only_full_blocks_are_hashed(tokens: list[int], block: int) -> None:
    assert len(chain_hashes(tokens, block)) == len(tokens) // block


@given(tokens_st, tokens_st, st.integers(1, 6))
def test_hashing_in_pieces_with_parent_equals_hashing_at_once(a: list[int], b: list[int],
                                                               block: int) -> None:
    head = a[: len(a) // block * block]
    whole = chain_hashes(head + b, block)
    first = chain_hashes(head, block)
    rest = chain_hashes(b, block, parent=first[-1] if first else None)
    assert whole == first + rest


def test_keys_are_fixed_across_processes_and_versions() -> None:
    # Golden values: a change here breaks every stored hash_ids trace made by convert.
    expected = [6701137901082075685, 10909650723565109255]
    assert chain_hashes(range(10), 4) == expected
    code = "from kvtool.trace.hashing import chain_hashes; print(chain_hashes(range(10), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == str(expected)


def test_keys_are_unsigned_64_bit() -> None:
    keys = chain_hashes(range(4096), 16)
    assert all(0 <= k < 2**64 for k in keys)
    assert len(set(keys)) == len(keys)


def test_extra_and_parent_separate_key_spaces() -> None:
    base = chain_hashes(range(8), 4)
    assert chain_hashes(range(8), 4, extra=b"lora-1") != base
    assert chain_hashes(range(8), 4, parent=0) != base


@pytest.mark.parametrize("tokens", [[-1, 0], [TOKEN_MAX + 1, 0], ["a", 1]])
def test_token_ids_outside_32_bits_are_rejected(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        chain_hashes(tokens, 1)  # type: ignore[arg-type]


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 0)
