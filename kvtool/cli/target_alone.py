"""``python -m kvtool.cli.target_alone``: the ``kvtool target`` commands alone.

Same commands, options, output and exit codes as ``kvtool target ...``, but it imports only
the target package (click, rich and the standard library). The QEMU engine runs it inside
the guest, whose emulated CPU (``-cpu qemu64``) lacks the instructions that numpy's wheels
need, so the full ``kvtool`` CLI (which loads every command module) cannot start there.

Example:
  python -m kvtool.cli.target_alone --json status --name demo
"""

from __future__ import annotations

import click

from kvtool.cli.main import ConventionsGroup, name_flags
from kvtool.cli.output import Settings
from kvtool.cli.target import command

name_flags(command)


@click.group(cls=ConventionsGroup, commands=dict(command.commands),
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "json_", is_flag=True, help="Machine output (JSON on stdout).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option("-q", "--quiet", is_flag=True, help="No notes on stderr.")
@click.pass_context
def main(ctx: click.Context, json_: bool, debug: bool, quiet: bool) -> None:
    """kvtool target commands (see: kvtool target --help). Exit codes: 0 success, 1 a check
    failed, 2 bad usage or input, 3 an internal error.

    \b
    Example:
      python -m kvtool.cli.target_alone up fixtures/targets/demo.toml
    """
    obj = ctx.ensure_object(Settings)
    obj.json = obj.json or json_
    obj.debug = debug
    obj.quiet = quiet


if __name__ == "__main__":
    main(prog_name="python -m kvtool.cli.target_alone")
