"""The KV object store on a namespace: layout, I/O engines, load / verify / bench.

Modules: :mod:`~kvtool.store.engine` (the I/O engine protocol and ``open_engine``),
:mod:`~kvtool.store.direct` (O_DIRECT engine), :mod:`~kvtool.store.bounce` (zero-copy vs
bounce-buffer object I/O), :mod:`~kvtool.store.layout` (superblock and index format),
:mod:`~kvtool.store.objectstore` (the store and its commit protocol),
:mod:`~kvtool.store.writer` / :mod:`~kvtool.store.reader` (pipelined bulk writes, slot reads),
:mod:`~kvtool.store.payload` / :mod:`~kvtool.store.keys` (deterministic content and keys),
:mod:`~kvtool.store.load`, :mod:`~kvtool.store.verify`, :mod:`~kvtool.store.bench`,
:mod:`~kvtool.store.inspect` (what the commands run). Format: docs/store-layout.md.

Nothing is imported here, so ``import kvtool.store`` stays cheap (numpy loads on use).
"""
