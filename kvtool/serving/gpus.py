"""GPU presets and user-defined GPUs: the figures a roofline step time needs (docs/serving.md).

Units: TFLOPS are dense (no 2:4 sparsity), 1e12 FLOP/s; bandwidths are GB/s = 1e9 B/s
**per direction**; ``memory_bytes`` is what the device reports as its total (GiB-based for
most cards). ``interconnect_gbps`` is what a tensor-parallel all-reduce runs over: NVLink
(or HCCS) per GPU and direction, or PCIe when the card has none. Every preset names its
source; figures marked "recalled, not verified" could not be checked against one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtool.errors import InputError, UsageError, param

_GIB = 2 ** 30


def _is_positive_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value > 0)


@dataclass(frozen=True)
class GPU:
    """One accelerator as the roofline sees it.

    Invariants: every figure is positive; ``fp8_tflops`` is ``None`` when the device has
    no FP8 tensor cores (FP8 weights then run at the BF16 rate after dequantisation).
    """

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    memory_bytes: int
    hbm_gbps: float
    interconnect_gbps: float
    pcie_gbps: float
    source: str

    def __post_init__(self) -> None:
        for key in ("bf16_tflops", "hbm_gbps", "interconnect_gbps", "pcie_gbps"):
            value = getattr(self, key)
            if not _is_positive_number(value):
                raise UsageError(f"must be a positive number, got {value!r}", field=key)
        if self.fp8_tflops is not None and not _is_positive_number(self.fp8_tflops):
            raise UsageError(f"must be a positive number, got {self.fp8_tflops!r}",
                             field="fp8_tflops")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) \
                or self.memory_bytes <= 0:
            raise UsageError(f"must be a positive whole number of bytes, got "
                             f"{self.memory_bytes!r}", field="memory_bytes")

    def peak_tflops(self, weight_dtype: str) -> float:
        """Dense tensor-core peak for weights stored as ``weight_dtype``.

        FP8 (and narrower) weights use the FP8 rate where the device has one (W8A8, as vLLM
        runs FP8 checkpoints on Hopper and Blackwell); elsewhere the BF16 rate.
        """
        if weight_dtype in ("fp8", "int8", "fp4", "int4") and self.fp8_tflops is not None:
            return self.fp8_tflops
        return self.bf16_tflops

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (docs/serving.md)."""
        return {"name": self.name, "bf16_tflops": self.bf16_tflops,
                "fp8_tflops": self.fp8_tflops, "memory_bytes": self.memory_bytes,
                "hbm_gbps": self.hbm_gbps, "interconnect_gbps": self.interconnect_gbps,
                "pcie_gbps": self.pcie_gbps, "source": self.source}


_AICONF = "ai-dynamo/aiconfigurator src/aiconfigurator/systems/"

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("a100-sxm", 312.0, None, 80 * _GIB, 2039.0, 300.0, 32.0,
        _AICONF + "a100_sxm.yaml: 312 TFLOPS BF16 dense, 2,039 GB/s, 80 GiB, NVLink 300 GB/s per "
        "direction (600 GB/s total), PCIe 4.0 32 GB/s; no FP8 tensor cores"),
    GPU("h100-sxm", 989.0, 1979.0, 80 * _GIB, 3350.0, 450.0, 64.0,
        _AICONF + "h100_sxm.yaml: 989 / 1,978 TFLOPS BF16 / FP8 dense, 3,350 GB/s, 80 GiB, "
        "NVLink 450 GB/s per direction, PCIe 5.0 64 GB/s"),
    GPU("h200-sxm", 989.0, 1979.0, 141 * _GIB, 4800.0, 450.0, 64.0,
        _AICONF + "h200_sxm.yaml: 989 / 1,978 TFLOPS BF16 / FP8 dense, 4,800 GB/s, 141 GiB, "
        "NVLink 450 GB/s per direction, PCIe 5.0 64 GB/s"),
    GPU("h20", 148.0, 296.0, 96 * _GIB, 4000.0, 450.0, 64.0,
        "alibaba/InferSim hardware/gpu.py (148 / 296 TFLOPS, 96 GB, NVLink 900 GB/s "
        "bidirectional = 450 per direction; it uses 4,096 GB/s HBM) and " + _AICONF
        + "h20_sxm.yaml (4,000 GB/s, PCIe 5.0 64 GB/s); 96 GB taken as GiB"),
    GPU("rtx-pro-6000", 467.8, 935.6, 97887 * 2 ** 20, 1792.0, 64.0, 64.0,
        _AICONF + "rtx_pro_6000_server.yaml (RTX PRO 6000 Blackwell Server Edition): 467.8 / "
        "935.6 TFLOPS BF16 / FP8 dense scaled to the observed 2,430 MHz clock (its estimate), "
        "1,792 GB/s GDDR7, 97,887 MiB as nvidia-smi reports; no NVLink, so TP runs over PCIe "
        "5.0 x16, 64 GB/s"),
    GPU("ascend-910b", 353.8, None, 64 * _GIB, 1600.0, 196.0, 32.0,
        "JiusiServe/light-llm-simulator conf/hardware_config.py (Ascend 910B2: 353.8 TFLOPS "
        "FP16 cube, 64 GB, 1.6 TB/s, intra-node HCCS 196 GB/s); BF16 taken = FP16; PCIe 4.0 "
        "x16 32 GB/s recalled, not verified; no FP8"),
)}


def resolve_gpu(name: str, user: Mapping[str, GPU] | None = None) -> GPU:
    """A preset or user-defined GPU by name (case-insensitive; user GPUs win over presets)."""
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    for table in (user or {}, GPUS):
        for k, gpu in table.items():
            if k.lower() == key:
                return gpu
    known = sorted({*GPUS, *(user or {})})
    raise UsageError(f"unknown GPU {name!r} (known: {', '.join(known)}; or define it in the "
                     f"cluster file's [gpu.NAME] table)", field="gpu")


_KEYS = {"bf16_tflops", "fp8_tflops", "memory_gib", "memory_bytes", "hbm_gbps",
         "interconnect_gbps", "pcie_gbps", "source", "base"}


def gpu_from_table(table: Mapping[str, Any], where: Any) -> GPU:
    """A user GPU from a TOML table; ``where`` locates errors.

    ``where`` is ``(ConfigDocument, key_path)`` (errors name file, line and key via
    ``ConfigDocument.error``; the table's key is the default name), a callable
    ``where(key, message) -> InputError``, or a file name (errors name file and key). Keys:
    ``name`` (or the table's own key in the path), ``base`` (a preset whose figures are the
    defaults), ``bf16_tflops``, ``fp8_tflops``, ``memory_gib`` or ``memory_bytes``,
    ``hbm_gbps``, ``interconnect_gbps``, ``pcie_gbps``, ``source``. Without ``base`` every
    figure but ``fp8_tflops`` is required.
    """
    fail = _failer(where)
    if not isinstance(table, Mapping):
        raise fail("", "must be a table")
    for key in table:
        if key not in _KEYS and key != "name":
            raise fail(key, f"unknown key (known: {', '.join(sorted(_KEYS | {'name'}))})")
    name = table.get("name", _default_name(where))
    if not isinstance(name, str) or not name.strip():
        raise fail("name", "must be a non-empty string")
    values: dict[str, Any] = {}
    if "base" in table:
        try:
            values = resolve_gpu(str(table["base"])).to_dict()
        except UsageError as exc:
            raise fail("base", exc.message) from None
    if "memory_gib" in table and "memory_bytes" in table:
        raise fail("memory_bytes", "give memory_gib or memory_bytes, not both")
    for key in ("bf16_tflops", "fp8_tflops", "hbm_gbps", "interconnect_gbps", "pcie_gbps"):
        if key in table:
            values[key] = _number(table[key], key, fail)
    if "memory_gib" in table:
        values["memory_bytes"] = int(_number(table["memory_gib"], "memory_gib", fail) * _GIB)
    elif "memory_bytes" in table:
        mb = table["memory_bytes"]
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise fail("memory_bytes", f"must be a positive whole number of bytes, got {mb!r}")
        values["memory_bytes"] = mb
    for key in ("bf16_tflops", "memory_bytes", "hbm_gbps", "interconnect_gbps", "pcie_gbps"):
        if key not in values:
            shown = "memory_gib" if key == "memory_bytes" else key
            raise fail(shown, f"required (or give {param('base')} = a preset to start from)")
    source = table.get("source", "user-defined" + (f", based on {table['base']}"
                                                   if "base" in table else ""))
    if not isinstance(source, str):
        raise fail("source", "must be a string")
    return GPU(name=name.strip(), bf16_tflops=values["bf16_tflops"],
               fp8_tflops=values.get("fp8_tflops"), memory_bytes=values["memory_bytes"],
               hbm_gbps=values["hbm_gbps"], interconnect_gbps=values["interconnect_gbps"],
               pcie_gbps=values["pcie_gbps"], source=source)


def _failer(where: Any) -> Any:
    if callable(where):
        return where
    if where is None or isinstance(where, str):
        def plain(key: str, message: str) -> InputError:
            return InputError(message, file=where, field=key or None)
        return plain
    doc, path = where
    path = tuple(path)

    def fail(key: str, message: str) -> InputError:
        err: InputError = doc.error(message, (*path, key) if key else path)
        return err
    return fail


def _default_name(where: Any) -> Any:
    if isinstance(where, tuple):
        path = tuple(where[1])
        if path and isinstance(path[-1], str):
            return path[-1]
    return None


def _number(value: Any, key: str, fail: Any) -> float:
    if not _is_positive_number(value):
        raise fail(key, f"must be a positive number, got {value!r}")
    return float(value)


def vllm_batch_defaults(gpu: GPU) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` vLLM picks for online serving on ``gpu``.

    vLLM 0.33.0 ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py), usage context
    OPENAI_API_SERVER: 16384 / 1024 on GPUs with at least 160 GiB; 8192 / 1024 on GPUs with
    at least 70 GiB that are not A100s; 2048 / 256 otherwise.
    """
    gib = 2 ** 30
    if gpu.memory_bytes >= 160 * gib:
        return 16384, 1024
    if gpu.memory_bytes >= 70 * gib and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256
