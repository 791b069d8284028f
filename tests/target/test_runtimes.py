"""The runtime registry (kvtool/target/runtimes.py) is the one list: ``kvtool target``'s
and ``kvtool cluster up``'s choices come from it, and every entry opens."""

from __future__ import annotations

import importlib

import click

from kvtool.target.runtimes import CHOICES, CLUSTER, RUNTIMES


def test_every_runtime_names_a_backend_class() -> None:
    for name, rt in RUNTIMES.items():
        module, _, cls = rt.backend.partition(":")
        backend = getattr(importlib.import_module(module), cls)
        assert {"plan_up", "plan_down", "status"} <= set(dir(backend)), name


def _choices(cmd: click.Command, option: str) -> tuple[str, ...]:
    [opt] = [p for p in cmd.params if p.name == option]
    assert isinstance(opt.type, click.Choice)
    return tuple(opt.type.choices)


def test_the_commands_take_their_choices_from_the_registry() -> None:
    from kvtool.cli.cluster import command as cluster
    from kvtool.cli.target import command as target

    assert _choices(target.commands["up"], "runtime") == CHOICES
    assert _choices(cluster.commands["up"], "runtime") == CLUSTER
    assert set(CLUSTER) <= set(CHOICES)
