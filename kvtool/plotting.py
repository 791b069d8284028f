"""matplotlib for every PNG kvtool writes: imported only when one is written (it is the
``plot`` extra), and one way to save it.

:func:`pyplot` imports it (Agg, no display) or raises :class:`~kvtool.errors.UsageError`
naming the extra; :func:`save` writes a figure and always closes it, turning an unwritable
path into a :class:`~kvtool.errors.UsageError` naming ``field``.
"""

from __future__ import annotations

import os
from typing import Any

from kvtool.errors import UsageError


def pyplot(field: str = "plot") -> Any:
    """``matplotlib.pyplot`` on the Agg backend (``field``: the parameter that asked)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("matplotlib is not installed; install the plot extra: "
                         "pip install 'kvtool[plot]'", field=field) from None
    return plt


def save(fig: Any, path: str | os.PathLike[str], *, field: str = "plot", dpi: int = 90) -> None:
    """Write ``fig`` to ``path`` (its folder created) and close it."""
    import matplotlib.pyplot as plt

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}", field=field) from None
    finally:
        plt.close(fig)
