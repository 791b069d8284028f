"""The ``kvtool`` group: global options, error → exit-code mapping, sub-command registry.

Exit codes (README, docs/json.md): 0 success; 1 a check failed (:class:`~kvtool.errors.CheckFailed`);
2 bad usage or input (click usage errors, :class:`~kvtool.errors.InputError`); 3 an
internal error (a bug: please report it with the ``--debug`` traceback).
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import Any

import click

from kvtool import __version__
from kvtool.cli.helpfmt import fit_help
from kvtool.cli.output import Settings, err_console
from kvtool.errors import KvtoolError, UsageError

# One module per command under kvtool/cli/, each exposing ``command`` (a click command or
# group), with the line ``kvtool --help`` lists for it: the list is printed from here, so
# that it imports no command (bench/startup.py), and each command gets its line as its
# short help when it is loaded. A line fits the list at 80 columns (tests/cli/test_main.py).
# Keep this sorted; add an entry when a command lands.
COMMANDS: dict[str, str] = {
    "audit": "Audit KV object sizes and placements against 512 B / 4 KiB LBAs",
    "bench": "Measure GB/s, IOPS and latency of object-sized I/O on a target",
    "calibrate": "Fit the serving model's MFU, eta and c0 to vllm bench results",
    "cluster": "Bring a cluster's nodes, targets and Mooncake up and down",
    "experiment": "Re-run the published tiering experiments at laptop scale",
    "load": "Write KV objects, indexed and CRC32C-checked, onto a target",
    "plan": "How much cache a workload needs: from a trace or the formula",
    "pool": "Start, stop and report a Mooncake Store pool on 127.0.0.1",
    "replay": "Replay a request trace through a GPU → DRAM → NVMe prefix cache",
    "store": "Inspect the KV object store on a namespace",
    "target": "Provision NVMe-oF targets (SPDK, kernel nvmet, the emulator)",
    "trace": "Make traces and look inside them (Mooncake, Qwen, Azure, …)",
    "verify": "Verify every object on a target: checksum and content",
}

EXAMPLES = """
\b
Examples:
  kvtool audit --model deepseek-v4-flash --dtype fp8 --lba 512
  kvtool plan --sessions 112 --input-tokens 109030 --output-tokens 5000 \\
      --dram 429.5GB --model deepseek-v4-flash
  kvtool target up
  kvtool replay trace.jsonl
  kvtool replay trace.jsonl --simulate --model deepseek-v4-flash \\
      --dram 3000000tok --nvme 46.09TB --plot replay.png
  kvtool target up fixtures/targets/demo.toml
  kvtool load nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo/1 \\
      --object-bytes 1002240
  kvtool --json verify /dev/loop3
"""

INTERNAL_ERROR = 3


class ConventionsGroup(click.Group):
    """A click group with kvtool's error conventions: bad usage or input is one line and
    exit 2, a failed check exit 1, a bug one line and exit 3 (``--debug``: the traceback).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise _usage_exit(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # bad option/argument of any sub-command
            raise _usage_exit(exc) from None
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KvtoolError as exc:
            _report(ctx, exc, f"kvtool: error: {exc}")
            raise click.exceptions.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console().print("kvtool: interrupted")
            raise click.exceptions.Exit(130) from None
        except BrokenPipeError:
            raise click.exceptions.Exit(0) from None
        except Exception as exc:  # a bug: one line unless --debug
            _report(ctx, exc, f"kvtool: internal error: {type(exc).__name__}: {exc} "
                              "(run with --debug for the traceback)")
            raise click.exceptions.Exit(INTERNAL_ERROR) from None


class KvtoolGroup(ConventionsGroup):
    """The ``kvtool`` group. Sub-commands are imported on first use: ``kvtool replay`` must
    not pay for numpy, the store engines or the NVMe/TCP stack at start-up
    (bench/startup.py measures the whole process).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module = importlib.import_module(f"kvtool.cli.{cmd_name}")
            module.command.short_help = COMMANDS[cmd_name]
            name_flags(module.command)
            fit_help(module.command)
            self.add_command(module.command, cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's command list, with each command not loaded yet listed by its line in
        :data:`COMMANDS` (the short help it gets when loaded): no command is imported."""
        names = self.list_commands(ctx)  # those of COMMANDS, and any added by hand
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows: list[tuple[str, str]] = []
        for name in names:
            cmd = self.commands.get(name)
            if cmd is None:
                rows.append((name, COMMANDS[name]))
            elif not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def name_flags(cmd: click.Command) -> None:
    """Make ``cmd`` report library errors in its own flags.

    The library names the parameter it was given (``field="block_bytes"``); the user typed
    ``--block-bytes``. A :class:`~kvtool.errors.UsageError` whose field is the name of one
    of ``cmd``'s parameters (or a flag's name as an identifier) is rewritten to that flag
    (or argument, ``TARGET``) on its way out, and so is every parameter that any
    :class:`~kvtool.errors.KvtoolError`'s message names (:func:`~kvtool.errors.param`).
    """
    flags: dict[str, str] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            longs = [o for o in p.opts if o.startswith("--")]
            for o in longs:  # the flag's own name too: --pattern for a param pattern_text
                flags.setdefault(o[2:].replace("-", "_"), o)
            if p.name:
                flags[p.name] = longs[0] if longs else p.opts[0]
        elif p.name:
            flags[p.name] = p.human_readable_name
    invoke = cmd.invoke

    def invoke_naming_flags(ctx: click.Context) -> Any:
        try:
            return invoke(ctx)
        except KvtoolError as exc:
            if isinstance(exc, UsageError) and exc.file is None and exc.field in flags:
                exc.rename_field(flags[exc.field])
            exc.name_params(flags)
            raise

    cmd.invoke = invoke_naming_flags  # type: ignore[method-assign]
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            name_flags(sub)


def _usage_exit(exc: click.UsageError) -> click.exceptions.Exit:
    """Bad usage as one line (docs/json.md), naming the command to ask for --help. A group
    given no command (``kvtool``, ``kvtool target``) prints its help instead, on stderr
    with exit 2, as click does."""
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        exc.show()
        return click.exceptions.Exit(exc.exit_code)
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    click.echo(f"kvtool: error: {exc.format_message()}{where}", err=True)
    return click.exceptions.Exit(exc.exit_code)


def _report(ctx: click.Context, exc: BaseException, line: str) -> None:
    obj = ctx.find_object(Settings)
    if obj is not None and obj.debug:
        import traceback  # only with --debug: not worth its import time otherwise

        traceback.print_exception(exc, file=sys.stderr)
    click.echo(line, err=True)


@click.group(cls=KvtoolGroup, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"],
                                                                  "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="kvtool")
@click.option("--json", "json_", is_flag=True, help="Machine output (JSON on stdout) for any command.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or notes on stderr.")
@click.pass_context
def cli(ctx: click.Context, json_: bool, debug: bool, quiet: bool) -> None:
    """kvtool: build, validate and size KV-cache storage tiers (GPU → DRAM → NVMe/NVMe-oF).

    Every command has --help with examples and --json for machine output. Exit codes:
    0 success, 1 a check failed, 2 bad usage or input, 3 an internal error (a bug:
    --debug shows the traceback).
    """
    obj = ctx.ensure_object(Settings)
    obj.json = obj.json or json_
    obj.debug = debug
    obj.quiet = obj.quiet or quiet


fit_help(cli)


def main() -> None:
    """The ``kvtool`` executable. It ends the process (click exits with the status)."""
    try:
        cli.main(prog_name="kvtool")
    finally:
        # The interpreter's shutdown runs one full collection over every object left
        # (each imported module's code and classes): 10-15 ms of a 0.1-s command, to free
        # memory the process hands back anyway. Frozen objects are skipped by it. Files and
        # processes are closed by the commands themselves, and atexit hooks still run.
        gc.freeze()
