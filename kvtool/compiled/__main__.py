"""``python -m kvtool.compiled build|status|clean``: the mypyc build of the serving model's
hot modules (:mod:`kvtool.compiled`)."""

from __future__ import annotations

import argparse
import sys

from kvtool.compiled import __doc__ as doc
from kvtool.compiled import matching_entry
from kvtool.compiled.build import build, clean

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m kvtool.compiled", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("build", "status", "clean"),
                    help="build: compile into the cache (unless there); status: the entry "
                         "kvtool would use, or why none (exit 1); clean: remove the cache")
    ap.add_argument("--python", help="the interpreter with mypy (default: this one)")
    a = ap.parse_args()
    if a.action == "build":
        print(build(a.python))
    elif a.action == "status":
        entry, why = matching_entry()
        print(entry if entry is not None else why)
        sys.exit(0 if entry is not None else 1)
    else:
        clean()
