"""Replay orchestration: ``kvtool replay`` as a library call, above the replayer.

* :mod:`kvtool.replay.config` — tier options and ``--tiers`` files → cache configurations;
* :mod:`kvtool.replay.run` — typed settings in, the report document out (simulate or data
  mode): the public face of ``settings``, ``prepare``, ``places``, ``media``,
  ``tierfactory``, ``job`` and ``report``;
* :mod:`kvtool.replay.data` — data mode: real bytes through the data tiers (:mod:`kvtool.tiers`).

This package sits above :mod:`kvtool.cache` (the replayer), :mod:`kvtool.tiers` and
:mod:`kvtool.target`; :mod:`kvtool.serving` (the serving model) sits beside it.
"""
