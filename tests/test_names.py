"""Words with one meaning (docs/definitions.md): a class name that the docs define is
defined once, and "cluster" names only the deployment package (kvtool/cluster, and the
command that drives it)."""

from __future__ import annotations

import ast

from tests.conftest import REPO

ONCE = ("TargetConfig", "TargetSpec", "Backend")
CLUSTER_OK = ("kvtool/cluster/", "kvtool/cli/cluster.py")


def _sources() -> list:
    return sorted(p for root in ("kvtool", "emulator") for p in (REPO / root).rglob("*.py"))


def test_each_defined_name_is_one_class() -> None:
    where: dict[str, list[str]] = {n: [] for n in ONCE}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in where:
                where[node.name].append(str(path.relative_to(REPO)))
    for name, found in where.items():
        assert len(found) == 1, f"{name} is defined in {found}"


def test_only_the_deployment_package_is_called_cluster() -> None:
    bad = [str(p.relative_to(REPO)) for p in _sources()
           if "cluster" in p.stem and not str(p.relative_to(REPO)).startswith(CLUSTER_OK)]
    assert not bad, f"modules named cluster outside the deployment package: {bad}"
