"""``python -m kvtool.target``: the ``kvtool target`` commands alone.

Same commands, options, output and exit codes as ``kvtool target ...``, but it imports only
the target package (click, rich and the standard library). The QEMU engine runs it inside
the guest, whose emulated CPU (``-cpu qemu64``) lacks the instructions that numpy's wheels
need, so the full ``kvtool`` CLI (which loads every command module) cannot start there.

Example:
  python -m kvtool.target --json status --name demo
"""

from __future__ import annotations

import sys

import click

from kvtool.cli.output import Settings
from kvtool.cli.target import command
from kvtool.errors import KvtoolError


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KvtoolError as exc:
            click.echo(f"kvtool: error: {exc}", err=True)
            raise click.exceptions.Exit(exc.exit_code) from None


@click.group(cls=_Group, commands=dict(command.commands),
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "json_", is_flag=True, help="Machine output (JSON on stdout).")
@click.option("-q", "--quiet", is_flag=True, help="No notes on stderr.")
@click.pass_context
def main(ctx: click.Context, json_: bool, quiet: bool) -> None:
    """kvtool target commands (see: kvtool target --help).

    \b
    Example:
      python -m kvtool.target up fixtures/targets/demo.toml
    """
    obj = ctx.ensure_object(Settings)
    obj.json = obj.json or json_
    obj.quiet = quiet


if __name__ == "__main__":
    sys.exit(main(prog_name="python -m kvtool.target"))
