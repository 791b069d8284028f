"""Click options shared by several commands, so one flag means one thing everywhere.

``block_size_options`` is the one way a command learns the size of a block
(docs/definitions.md, "Bytes per block"): ``--model``/``--dtype``/``--tp`` or
``--block-bytes``, resolved by :func:`kvtool.geometry.block_size`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvtool.units import parse_size

if TYPE_CHECKING:
    from kvtool.geometry.blocksize import BlockSize

F = TypeVar("F", bound=Callable[..., Any])


def _size(_ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    return parse_size(value, field=param.opts[0], allow_zero=False)


def block_size_options(f: F) -> F:
    """Add --model/-m, --dtype, --tp and --block-bytes (alias --object-bytes).

    The command receives ``model``, ``dtype``, ``tp`` (``None`` unless given) and
    ``block_bytes`` (an int); pass them to :func:`block_size_from`.
    """
    for opt in reversed([
        click.option("--model", "-m", metavar="NAME",
                     help="Model preset whose KV block to use (e.g. deepseek-v4-flash, "
                          "llama-3-70b; an unknown name lists them)."),
        click.option("--dtype", metavar="DTYPE",
                     help="KV dtype of --model (fp8, bf16, ...) [default: the model's]."),
        click.option("--tp", type=int, metavar="N",
                     help="Tensor-parallel size of --model: a block is one rank's shard "
                          "[default: 1]."),
        click.option("--block-bytes", "--object-bytes", "block_bytes", metavar="SIZE",
                     callback=_size,
                     help="Bytes of one block's KV object (e.g. 1002240, 32MiB) instead of "
                          "--model."),
    ]):
        f = opt(f)
    return f


def block_size_from(model: str | None, dtype: str | None, tp: int | None,
                    block_bytes: int | None, block_tokens: int) -> BlockSize | None:
    """The block size the options describe (``None`` when none of them was given)."""
    from kvtool.geometry.blocksize import block_size

    return block_size(model, dtype=dtype, tp=tp, block_tokens=block_tokens,
                      block_bytes=block_bytes)
