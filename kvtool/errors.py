"""Exceptions that the CLI turns into exit codes.

* :class:`InputError` (and :class:`UsageError`) — bad usage or bad input: exit 2, one line.
* :class:`CheckFailed` — a check ran and failed (corruption found, a bar missed): exit 1.
* :class:`AuthenticationFailed` — DH-HMAC-CHAP refused (either side): exit 1.

Library code raises these; only the CLI decides how they are shown.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from os import PathLike

_PARAM = "\x00([A-Za-z_][A-Za-z0-9_]*)\x00"
"""A :func:`param` in a message (compiled on first use: most runs raise no error)."""


def param(name: str) -> str:
    """A parameter named inside an error message (``f"... unless {param('force')}"``).

    Library users read the parameter's name (``force``); the CLI shows the flag the user
    types (``--force``): see :meth:`KvtoolError.name_params`.
    """
    return f"\x00{name}\x00"


class KvtoolError(Exception):
    """Base class of every error kvtool reports to a user without a traceback.

    The message may name parameters (:func:`param`): ``str(err)`` shows their names until
    :meth:`name_params` shows them as the caller (the CLI: its flags) names them.
    """

    exit_code = 2

    def __init__(self, message: str = "") -> None:
        self.raw_message = message
        self._params_named = False
        self.message = re.sub(_PARAM, r"\1", message) if "\x00" in message else message
        super().__init__(self._format())

    def name_params(self, flag_of: Callable[[str], str | None] | Mapping[str, str]) -> None:
        """Show the parameters the message names (:func:`param`) as ``flag_of`` names them.

        The first call wins: the innermost command, whose flags the user typed, names them.
        """
        if self._params_named or re.search(_PARAM, self.raw_message) is None:
            return
        self._params_named = True
        lookup = flag_of.get if isinstance(flag_of, Mapping) else flag_of
        self.message = re.sub(_PARAM, lambda m: lookup(m.group(1)) or m.group(1), self.raw_message)
        self.args = (self._format(),)

    def _format(self) -> str:
        return self.message


class InputError(KvtoolError):
    """Bad input: names the file, line and field when they are known.

    ``str(err)`` is the one line the CLI prints, e.g.
    ``trace.jsonl:17: field 'input_length': expected an integer, got "abc"``.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | PathLike[str] | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.file = None if file is None else str(file)
        self.line = line
        self.field = field
        super().__init__(message)

    def rename_field(self, field: str) -> None:
        """Name the field as the user knows it (the CLI maps parameter names to flags)."""
        self.field = field
        self.args = (self._format(),)

    def locate(self, file: str | PathLike[str] | None, line: int | None) -> None:
        """Say where the error is, when it does not say already: the ``file`` and ``line``
        fill only what is missing."""
        if self.file is None and file is not None:
            self.file = str(file)
        if self.line is None:
            self.line = line
        self.args = (self._format(),)

    def _format(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
        elif self.line is not None:
            where = f"line {self.line}"
        what = f"field '{self.field}': {self.message}" if self.field else self.message
        return f"{where}: {what}" if where else what


class UsageError(InputError):
    """A command-line value is wrong (``field`` is the option name, e.g. ``--lba``)."""


class AuthenticationFailed(KvtoolError):
    """In-band authentication (DH-HMAC-CHAP) failed; the message says which side: exit 1."""

    exit_code = 1


class CheckFailed(KvtoolError):
    """A check ran and failed; the command's report says what failed."""

    exit_code = 1
