"""KV-cache data types: canonical names, aliases and element sizes.

Generic dtypes (``fp8``, ``bf16``, ``fp16``, ``fp32``) store every element in a fixed
number of bytes. ``fp8_ds_mla`` is not an element type but vLLM's packed DeepSeek MLA
record (fp8 latent + scales + bf16 rope); its size per entry is a property of the model,
so presets that support it give the record size explicitly.
"""

from __future__ import annotations

from kvtool.errors import UsageError

#: Bytes per element of the generic dtypes.
DTYPE_BYTES: dict[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}

#: Packed per-entry records that only some models define (size comes from the model).
RECORD_DTYPES: tuple[str, ...] = ("fp8_ds_mla",)

_ALIASES: dict[str, str] = {
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8-e4m3": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8_ds_mla": "fp8_ds_mla",
    "fp8-ds-mla": "fp8_ds_mla",
}

KNOWN_DTYPES: tuple[str, ...] = (*DTYPE_BYTES, *RECORD_DTYPES)


def canonical_dtype(name: str, *, field: str = "dtype") -> str:
    """``"BF16"`` → ``"bf16"``, ``"float8_e4m3fn"`` → ``"fp8"``; unknown → :class:`UsageError`."""
    key = str(name).strip().lower()
    try:
        return _ALIASES[key]
    except KeyError:
        raise UsageError(
            f"unknown dtype {name!r} (known: {', '.join(KNOWN_DTYPES)})", field=field
        ) from None


def dtype_bytes(name: str, *, field: str = "dtype") -> int:
    """Bytes per element of a generic dtype (not of a packed record such as ``fp8_ds_mla``)."""
    canon = canonical_dtype(name, field=field)
    if canon not in DTYPE_BYTES:
        raise UsageError(
            f"{canon} is a model-specific packed record, not an element type; give the record "
            "size in bytes instead", field=field)
    return DTYPE_BYTES[canon]
