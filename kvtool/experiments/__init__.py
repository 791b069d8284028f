"""Published tiering experiments re-run at laptop scale, their figures beside the published ones.

Experiments are data (``fixtures/experiments/*.toml``, schema in :mod:`.spec`); a run makes
the workload, replays every configuration (or measures reads, or runs the serving model on
every configuration's cluster under every load: :mod:`.serving`), and computes each figure
(:mod:`.figures`). docs/experiments.md has the table.
"""

from kvtool.experiments.run import SCHEMA, run_experiment
from kvtool.experiments.spec import (
    Experiment,
    experiments_dir,
    find_experiment,
    list_experiments,
    load_experiment,
)

__all__ = ["SCHEMA", "Experiment", "experiments_dir", "find_experiment", "list_experiments",
           "load_experiment", "run_experiment"]
