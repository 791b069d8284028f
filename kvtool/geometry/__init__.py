"""Model KV geometry → bytes per token, object size per block (docs/geometry.md).

>>> g = resolve("deepseek-v4-flash", dtype="fp8")
>>> g.block_bytes, g.bytes_per_token
(1002240, 3915.0)
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.geometry.blocksize import BlockSize, block_size
    from kvtool.geometry.custom import custom, from_toml
    from kvtool.geometry.dtypes import DTYPE_BYTES, KNOWN_DTYPES, canonical_dtype
    from kvtool.geometry.model import (
        LAYOUTS,
        Component,
        ComponentSpec,
        KVGeometry,
        Layout,
        ModelSpec,
        ObjectSize,
    )
    from kvtool.geometry.params import Architecture, decoder_params
    from kvtool.geometry.presets import MODELS, PRESETS, lookup, resolve

__getattr__, __dir__ = exports(__name__, {
    "Architecture": "params",
    "BlockSize": "blocksize",
    "Component": "model",
    "ComponentSpec": "model",
    "DTYPE_BYTES": "dtypes",
    "KNOWN_DTYPES": "dtypes",
    "KVGeometry": "model",
    "LAYOUTS": "model",
    "Layout": "model",
    "MODELS": "presets",
    "ModelSpec": "model",
    "ObjectSize": "model",
    "PRESETS": "presets",
    "block_size": "blocksize",
    "canonical_dtype": "dtypes",
    "custom": "custom",
    "decoder_params": "params",
    "from_toml": "custom",
    "lookup": "presets",
    "resolve": "presets",
})

__all__ = [
    "DTYPE_BYTES",
    "KNOWN_DTYPES",
    "LAYOUTS",
    "MODELS",
    "PRESETS",
    "Architecture",
    "BlockSize",
    "Component",
    "ComponentSpec",
    "KVGeometry",
    "Layout",
    "ModelSpec",
    "ObjectSize",
    "block_size",
    "canonical_dtype",
    "custom",
    "decoder_params",
    "from_toml",
    "lookup",
    "resolve",
]
