"""vLLM's own v1 KV cache manager, loaded without torch and without ``vllm/__init__.py``.

``load_vllm_core()`` returns a :class:`VLLMCore` holding vLLM's unmodified
``vllm.v1.core.kv_cache_manager`` (and what it imports: the coordinator, the single-type
managers, ``block_pool``, ``kv_cache_utils``, ``vllm.v1.request``), read from the installed
vllm wheel (``pip install --no-deps vllm==0.33.0`` plus the pure-Python packages listed in
``tox.ini``). It is the oracle of ``tests/serving/test_kvpool_vllm.py``.

How (docs/serving.md, "Driving vLLM's code without a GPU"): vLLM's top-level
``__init__`` patches torch, and the ``__init__`` of a few subpackages pull in the whole
engine, so the loader puts *empty* package modules (only ``__path__`` set) in
``sys.modules`` for those packages: Python then finds the submodules in their files and
executes only them. What only type hints or unrelated features use (torch, transformers,
uvloop, the multimodal package, …) gets a permissive stand-in module: any attribute is a
class, so ``torch.Tensor`` in an annotation, ``torch.float16`` in a dict or a subclass of
``transformers.PretrainedConfig`` all work, and nothing in the cache logic calls them.
The stand-ins for third-party names are removed from ``sys.modules`` afterwards so that
other tests still see the real packages (or their absence).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
"""The vLLM release the oracle was written against (tox.ini installs it)."""

# Packages whose __init__ must not run: empty packages whose submodules load from files.
_HOLLOW_PACKAGES = ("vllm", "vllm.config", "vllm.distributed", "vllm.v1.structured_output")

# Modules replaced by permissive stand-ins (type hints and unrelated features only).
_STAND_INS = ("torch", "vllm.multimodal", "vllm.utils.torch_utils", "vllm.tokenizers",
              "vllm.usage", "uvloop", "transformers", "prometheus_client", "PIL")


class _StubMeta(type):
    """Metaclass of stand-in classes: any class attribute is another stand-in class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls

    def __getitem__(cls, item: Any) -> Any:
        return cls


def _stub_class(name: str) -> type:
    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    return _StubMeta(name, (), {"__init__": _init, "__call__": lambda self, *a, **k: self})


class StubModule(types.ModuleType):
    """A module whose every attribute is a stand-in class (``from x import Y`` works)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so ``import torch.cuda`` works too

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _HollowPackage(types.ModuleType):
    """A package whose ``__init__`` is not run: submodules load from their files, and a name
    its ``__init__`` would have re-exported is a stand-in class (used in type hints only)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        base = Path(self.__path__[0])
        if (base / f"{name}.py").exists() or (base / name / "__init__.py").exists():
            return importlib.import_module(f"{self.__name__}.{name}")
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-ins for ``_STAND_INS`` (and their submodules) during the load."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == s or fullname.startswith(s + ".") for s in _STAND_INS):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@dataclass(frozen=True)
class VLLMCore:
    """The vLLM modules the tests drive."""

    kv_cache_manager: types.ModuleType
    kv_cache_utils: types.ModuleType
    kv_cache_interface: types.ModuleType
    request: types.ModuleType
    version: str

    def make_manager(self, num_gpu_blocks: int, block_size: int, *, max_model_len: int,
                     enable_caching: bool = True, watermark: float = 0.0) -> Any:
        """A ``KVCacheManager`` for one full-attention group, as vLLM's scheduler builds it."""
        kvi = self.kv_cache_interface
        spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                     dtype=_stub_class("torch.float16"))
        config = kvi.KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[],
                                   kv_cache_groups=[kvi.KVCacheGroupSpec(["layer.0"], spec)])
        return self.kv_cache_manager.KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=enable_caching, log_stats=True,
            watermark=watermark)


def vllm_location() -> Path | None:
    """The installed vllm package directory, found without importing it (or ``None``)."""
    mod = sys.modules.get("vllm")
    if mod is not None:
        # registered already (here or by tests/helpers/vllm_offload.py) as a package
        # whose __init__ never ran: its __path__ is the installed directory
        paths = list(getattr(mod, "__path__", None) or [])
        return Path(paths[0]) if paths else None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_CACHE: dict[str, VLLMCore] = {}


def load_vllm_core() -> VLLMCore:
    """Load vLLM's v1 core modules from the installed wheel (once per process)."""
    if "core" in _CACHE:
        return _CACHE["core"]
    root = vllm_location()
    if root is None:
        raise ImportError("vllm is not installed (pip install --no-deps vllm==0.33.0)")
    before = set(sys.modules)
    for name in _HOLLOW_PACKAGES:
        if name in sys.modules:
            continue
        mod = _HollowPackage(name)
        rel = name.split(".")[1:]
        mod.__path__ = [str(root.joinpath(*rel))]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__spec__.submodule_search_locations = mod.__path__
        sys.modules[name] = mod
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        kvm = importlib.import_module("vllm.v1.core.kv_cache_manager")
        kvu = importlib.import_module("vllm.v1.core.kv_cache_utils")
        kvi = importlib.import_module("vllm.v1.kv_cache_interface")
        req = importlib.import_module("vllm.v1.request")
        version = _read_version(root)
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if not name.startswith("vllm") and isinstance(sys.modules[name], StubModule):
                del sys.modules[name]
    core = VLLMCore(kvm, kvu, kvi, req, version)
    _CACHE["core"] = core
    return core


def _read_version(root: Path) -> str:
    """vllm's version from its ``_version.py`` (without importing ``vllm``)."""
    ns: dict[str, Any] = {}
    exec(compile((root / "_version.py").read_text(), "_version.py", "exec"), ns)
    return str(ns.get("__version__", "?"))


def block_hasher_for(keys: list[bytes], block_size: int) -> Callable[[Any], list[bytes]]:
    """A vLLM ``block_hasher`` that returns the given keys (one per full block, in order)."""

    def hasher(request: Any) -> list[bytes]:
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        return keys[start:end]

    return hasher


class Seq:
    """A request as :class:`kvtool.serving.kvpool.KVPool` reads it (``SeqLike``).

    ``keys`` are the chained keys of the request's whole token stream (prompt and the
    output it will generate), one per block; ``block_hashes`` shows those of the full
    blocks of the tokens so far, as vLLM's ``Request.block_hashes`` does.
    """

    __slots__ = ("block_tokens", "keys", "num_computed_tokens", "num_preemptions",
                 "num_prompt_tokens", "num_tokens", "request_id")

    def __init__(self, request_id: str, keys: list[int], num_prompt_tokens: int,
                 block_tokens: int) -> None:
        self.request_id = request_id
        self.keys = keys
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_tokens = block_tokens

    @property
    def block_hashes(self) -> list[int]:
        return self.keys[: self.num_tokens // self.block_tokens]


def key_bytes(key: int) -> bytes:
    """A kvtool int key as a vLLM ``BlockHash`` (bytes)."""
    return key.to_bytes(16, "big", signed=True)
