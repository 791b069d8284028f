import os
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from kvtool import __version__
from kvtool.cli.main import cli
from tests.conftest import REPO


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_help_lists_examples_and_every_exit_code() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    text = " ".join(result.output.split())
    for code in ("0 success", "1 a check failed", "2 bad usage", "3 an internal error"):
        assert code in text, code


def test_every_command_has_help_with_example() -> None:
    ctx = click.Context(cli)

    def walk(cmd, path):  # through get_command: commands are loaded on first use
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, name), [*path, name])

    for path, _cmd in walk(cli, []):
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, path
        assert "kvtool" in result.output and "xample" in result.output, f"{path}: no example in --help"


HELP_AFTER_LOADING = """
import click
from kvtool.cli.main import COMMANDS, cli
ctx = click.Context(cli)
for name in COMMANDS:
    cli.get_command(ctx, name)
cli.main(["--help"], prog_name="kvtool")
"""


def test_the_command_list_is_the_same_before_and_after_the_commands_load() -> None:
    """``kvtool --help`` lists commands not loaded yet from ``COMMANDS``; once loaded, each
    lists its own short help. Both lists are the same, one line per command at 80 columns."""
    env = {**os.environ, "COLUMNS": "80"}
    lazy = subprocess.run([sys.executable, "-m", "kvtool", "--help"], capture_output=True,
                          text=True, cwd=REPO, env=env, check=True).stdout
    loaded = subprocess.run([sys.executable, "-c", HELP_AFTER_LOADING], capture_output=True,
                            text=True, cwd=REPO, env=env, check=True).stdout
    assert lazy == loaded
    listed = lazy.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    from kvtool.cli.main import COMMANDS

    assert [line.split()[0] for line in listed] == sorted(COMMANDS)
    assert all(len(line) <= 80 for line in lazy.splitlines())


def test_every_command_list_fits_80_columns_uncut() -> None:
    """Each group's list of commands shows each command's whole line at 80 columns: one
    line per command, none cut with "..." (click's default for a long first sentence)."""
    ctx = click.Context(cli)
    groups = [[]] + [[name] for name in cli.list_commands(ctx)
                     if isinstance(cli.get_command(ctx, name), click.Group)]
    assert len(groups) > 1
    for path in groups:
        result = CliRunner().invoke(cli, [*path, "--help"], prog_name="kvtool",
                                    env={"COLUMNS": "80"})
        assert result.exit_code == 0, path
        listed = result.output.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        group = cli if not path else cli.get_command(ctx, path[0])
        assert isinstance(group, click.Group)
        assert [line.split()[0] for line in listed] == group.list_commands(ctx), path
        assert all(len(line) <= 80 and not line.endswith("...") for line in listed), listed


def test_a_group_without_a_command_prints_its_help() -> None:
    """As click does (exit 2, the help on stderr), not as a one-line usage error."""
    for path in ([], ["target"]):
        result = CliRunner().invoke(cli, path, prog_name="kvtool")
        assert result.exit_code == 2, path
        assert result.stderr.startswith(f"Usage: {' '.join(['kvtool', *path])} "), result.stderr
        assert "error" not in result.stderr.split("\n", 1)[0]
        assert "Commands:" in result.stderr and result.stdout == ""


def test_unknown_command_is_usage_error() -> None:
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code == 2


def test_python_dash_m() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtool", "--version"], capture_output=True,
                         text=True, cwd=REPO, check=True)
    assert __version__ in out.stdout


def test_usage_errors_are_one_line_naming_the_option() -> None:
    for args, words in [
        (["--nosuch"], ["--nosuch"]),
        (["nosuch"], ["nosuch"]),
        (["replay", "x.jsonl", "--policy", "bogus"], ["--policy", "bogus", "replay --help"]),
        (["trace", "stats"], ["TRACE"]),
    ]:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvtool: error: "), result.stderr
        assert all(w in lines[0] for w in words), lines[0]


def test_every_json_document_names_its_schema() -> None:
    from tests.conftest import FIXTURES, run_json

    trace = str(FIXTURES / "traces" / "multiturn-4x6.tokens.jsonl")
    docs = {
        "audit": run_json("audit", "--object-bytes", "1002240"),
        "plan": run_json("plan", "--sessions", "4", "--input-tokens", "512", "--output-tokens",
                         "256", "--dram", "64blk"),
        "trace.stats": run_json("trace", "stats", trace),
        "replay": run_json("replay", "--simulate", trace, "--dram", "32blk"),
    }
    versions = {"replay": 2}
    for name, doc in docs.items():
        assert doc["schema"] == f"kvtool.{name}/{versions.get(name, 1)}", name


def test_python_dash_m_kvtool_cli_target_alone_follows_the_cli_conventions(tmp_path: Path) -> None:
    env = {**os.environ, "KVTOOL_STATE_DIR": str(tmp_path)}
    for args, words in ((["up", "--bogus"], ["No such option"]),
                        (["up", str(tmp_path / "none.toml")], ["no such file"])):
        p = subprocess.run([sys.executable, "-m", "kvtool.cli.target_alone", *args],
                           capture_output=True, text=True, env=env)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("kvtool: error:") and all(w in lines[0] for w in words)
    p = subprocess.run([sys.executable, "-m", "kvtool.cli.target_alone", "--help"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0 and "3 an internal error" in " ".join(p.stdout.split())


def test_internal_errors_exit_3_in_one_line_and_debug_shows_the_traceback() -> None:
    from kvtool.cli.main import ConventionsGroup
    from kvtool.cli.output import Settings

    @click.group(cls=ConventionsGroup)
    @click.option("--debug", is_flag=True)
    @click.pass_context
    def group(ctx: click.Context, debug: bool) -> None:
        ctx.ensure_object(Settings).debug = debug

    @group.command()
    def boom() -> None:
        raise RuntimeError("a bug")

    result = CliRunner().invoke(group, ["boom"])
    assert result.exit_code == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error: RuntimeError: a bug" in lines[0]
    result = CliRunner().invoke(group, ["--debug", "boom"])
    assert result.exit_code == 3 and "Traceback" in result.stderr


def test_library_errors_name_parameters_and_the_cli_shows_flags() -> None:
    from kvtool.errors import UsageError, param
    from kvtool.units import Capacity
    from tests.conftest import run

    try:
        Capacity.parse("1GB").blocks(0, 256)
    except UsageError as exc:
        assert "(model or block_bytes)" in str(exc) and "--" not in str(exc)
    result = run("plan", "--sessions", "2", "--input-tokens", "10", "--output-tokens", "1",
                 "--dram", "1GB")
    assert result.exit_code == 2
    assert "field '--dram'" in result.stderr and "--model or --block-bytes" in result.stderr
    assert str(UsageError(f"use {param('force')}", field="target")) == \
        "field 'target': use force"
    # a nested command (target up) names its own flag, not its group's
    result = run("target", "up", "--dry-run", str(REPO / "fixtures" / "targets" /
                                                  "spdk-production.toml"))
    assert result.exit_code == 2 and "--allow-remote is given" in result.stderr


def test_check_failures_name_parameters_and_the_cli_shows_flags() -> None:
    """Every library error, not only bad input, names parameters through param()."""
    from kvtool.cli.main import ConventionsGroup, name_flags
    from kvtool.cli.output import Settings
    from kvtool.errors import CheckFailed, param

    failed = CheckFailed(f"tier lost; {param('on_tier_error')} recompute goes on")
    assert str(failed) == "tier lost; on_tier_error recompute goes on"

    @click.group(cls=ConventionsGroup)
    @click.pass_context
    def group(ctx: click.Context) -> None:
        ctx.ensure_object(Settings)

    @group.command()
    @click.option("--on-tier-error", default="fail")
    def go(on_tier_error: str) -> None:
        raise failed

    name_flags(group)
    result = CliRunner().invoke(group, ["go"])
    assert result.exit_code == 1
    assert result.stderr.strip() == \
        "kvtool: error: tier lost; --on-tier-error recompute goes on"


def test_quiet_and_json_work_before_and_after_the_command(tmp_path: Path) -> None:
    """-q, like --json, is accepted by the group and by every command that has --json."""
    ctx = click.Context(cli)

    def walk(cmd: click.Command, path: list[str]) -> None:
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        if "--json" in opts:
            assert {"-q", "--quiet"} <= opts, path
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                walk(sub, [*path, name])

    walk(cli, [])
    trace = tmp_path / "t.jsonl"
    good = (REPO / "fixtures" / "traces" / "multiturn-8x12.jsonl").read_text()
    trace.write_text("not json\n" + good)
    args = ["--simulate", str(trace), "--dram", "100blk", "--skip-bad", "1"]
    loud = CliRunner().invoke(cli, ["replay", *args])
    assert loud.exit_code == 0 and "skipped bad line 1" in loud.stderr
    for argv in (["-q", "replay", *args], ["replay", *args, "-q"], ["replay", "--quiet", *args]):
        quiet = CliRunner().invoke(cli, argv)
        assert quiet.exit_code == 0 and quiet.stderr == "", (argv, quiet.stderr)
