"""JSON-RPC to a running ``spdk_tgt``/``nvmf_tgt`` through the PyPI ``spdk`` client.

``spdk.rpc.client.JSONRPCClient`` speaks SPDK's wire format (bare JSON-RPC 2.0 objects on
a Unix stream socket). Methods are called by name: the per-method wrappers were removed in
SPDK 26.01 (python/spdk/rpc in the SPDK tree; docs/target.md). Errors come back as text;
:class:`SpdkError` keeps the method, the parameters and SPDK's ``{"code", "message"}`` so
the CLI can print one line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from typing import Any

from kvtool.errors import InputError
from kvtool.target.plan import TargetError

DEFAULT_SOCKET = "/var/tmp/spdk.sock"


def require_client() -> Any:
    """The PyPI ``spdk`` client module, or one line saying how to install it (exit 2)."""
    try:
        from spdk.rpc import client
    except ImportError:
        raise InputError("SPDK's JSON-RPC client is not installed: install kvtool[spdk] "
                         "(pip install 'kvtool[spdk]')") from None
    return client


class SpdkError(TargetError):
    def __init__(self, method: str, message: str, code: int | None = None) -> None:
        self.method = method
        self.code = code
        super().__init__(f"SPDK {method}: {message}" + (f" (code {code})" if code is not None else ""))


def _parse_error(text: str) -> tuple[str, int | None]:
    """SPDK's error object out of JSONRPCException's message text."""
    m = re.search(r"response:\s*(\{.*\})\s*$", text, re.S)
    if m:
        try:
            err = json.loads(m.group(1))
            return str(err.get("message", text)), err.get("code")
        except json.JSONDecodeError:
            pass
    return text.strip().splitlines()[0] if text.strip() else "error", None


class RpcUnreachable(TargetError):
    """Nothing accepts connections on the RPC socket (yet): no socket file, or one that
    is not listening — a starting application binds it a moment before it listens."""


class SpdkRpc:
    """A connection to one SPDK application's RPC socket (opened on first call)."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 60.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._client: Any = None
        self.calls: list[tuple[str, dict[str, Any]]] = []  # what was sent, for the report

    def _connect(self) -> Any:
        client = require_client()
        JSONRPCClient, JSONRPCException = client.JSONRPCClient, client.JSONRPCException
        if not os.path.exists(self.socket_path):
            raise RpcUnreachable(f"no SPDK RPC socket at {self.socket_path}: is spdk_tgt running? "
                              "(start it with: spdk_tgt -r SOCKET, or give --spdk-socket)")
        try:
            return JSONRPCClient(self.socket_path, timeout=self.timeout)
        except JSONRPCException as exc:
            raise RpcUnreachable(f"cannot connect to SPDK at {self.socket_path}: "
                              f"{exc.message.splitlines()[-1]}") from None

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        JSONRPCException = require_client().JSONRPCException
        if self._client is None:
            self._client = self._connect()
        sent = copy.deepcopy(params or {})
        self.calls.append((method, sent))
        try:
            # the client adds method/req_id to the dict it is given when a call fails
            return self._client.call(method, copy.deepcopy(sent))
        except JSONRPCException as exc:
            message, code = _parse_error(exc.message)
            raise SpdkError(method, message, code) from None

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(OSError):
                self._client.close()
            self._client = None

    def __enter__(self) -> SpdkRpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
