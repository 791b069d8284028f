"""The embedded default target: what ``kvtool target up`` brings up without a CONFIG.

kvtool's own userspace NVMe/TCP target on 127.0.0.1:4420 (the shape of
``fixtures/targets/demo.toml``) serving one memory-backed namespace large enough for the
default data-mode replay (``kvtool replay trace.jsonl`` puts its NVMe tier there) of the
README's quick-start trace: 16 sessions of 20 rounds, 3,125 DeepSeek-V4-Flash FP8 blocks
(3.1 GB). Memory is taken as blocks are written, not up front.
"""

from __future__ import annotations

from kvtool.target.config import TargetConfig
from kvtool.target.loader import parse_config

NAME = "kvtool"
NQN = "nqn.2026-01.io.kvtool:default"
PORT = 4420
NAMESPACE_BYTES = 4 << 30
SOURCE = "<built-in default target>"

_TEMPLATE = """\
backend = "emulator"
name = "{name}"

[emulator]
runtime = "userspace"

[[subsystem]]
nqn = "{nqn}"
serial = "KVTOOLDEFAULT01"
model = "kvtool emulator"
hosts = ["@local"]

  [[subsystem.namespace]]
  nsid = 1
  size = {size}
  lba = 512

[[listener]]
transport = "tcp"
address = "127.0.0.1"
port = {port}
"""


def text(port: int = PORT) -> str:
    """The default config as TOML (``kvtool target up`` without CONFIG applies it)."""
    return _TEMPLATE.format(name=NAME, nqn=NQN, size=NAMESPACE_BYTES, port=port)


def config(port: int = PORT) -> TargetConfig:
    return parse_config(text(port), source=None, default_name=NAME)


def url(port: int = PORT) -> str:
    return f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
