"""The commands the docs show cannot drift (docs/architecture.md, "Tests").

Every command line in a ```console or ```sh block of README.md and docs/*.md:

* a ``kvtool …`` (or ``python -m kvtool.cli.target_alone …``) line names a command that
  exists, every option it passes is one of that command's, and its arguments fit (click's
  own parser, without converting values: docs write placeholders such as ``NQN``); the
  command's ``--help`` exits 0;
* a ``python -m MODULE …`` line of kvtool or the emulator: ``--help`` of the module (and of
  its sub-command) exits 0 and names every option the line passes;
* the lines that need no root, no running target and no network (``RUNS``) run, in the
  order the page shows them, in a scratch directory holding ``fixtures/`` and the traces
  the pages name, and exit 0.

Other programs (``make``, ``fio``, ``curl``, ``vllm``) are not kvtool's and are left alone.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvtool.cli.main import cli
from kvtool.cli.target_alone import main as target_alone
from tests.conftest import FIXTURES, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCES = ("```console", "```sh")


@dataclass(frozen=True)
class Line:
    where: str  # page:line
    words: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


def _split(text: str) -> list[list[str]]:
    """The simple commands of one shell line (``&&``, ``;``, ``|``, ``&`` separate them;
    redirections and ``VAR=value`` prefixes dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    skip_next = False
    for tok in lexer:
        if skip_next:
            skip_next = False
            continue
        if tok and set(tok) <= set("&|;"):
            out.append([])
        elif tok and set(tok) <= set("<>"):
            skip_next = True  # the file it redirects to
        elif not out[-1] and re.fullmatch(r"[A-Z_]+=\S*", tok):
            continue
        else:
            out[-1].append(tok)
    return [c for c in out if c]


def command_lines() -> list[Line]:
    """Every command of every ```console / ```sh block, continuations joined, prompts and
    output lines of a console block dropped."""
    found: list[Line] = []
    for page in PAGES:
        fence: str | None = None
        cur: str | None = None
        start = 0
        for n, raw in enumerate(page.read_text().splitlines(), 1):
            s = raw.strip()
            if fence is None:
                if s in FENCES:
                    fence = s
                continue
            if s == "```":
                fence = None
                continue
            if cur is None:
                if fence == "```console":
                    if not s.startswith("$ "):
                        continue  # the command's output
                    s = s[2:]
                if not s or s.startswith("#"):
                    continue
                cur, start = "", n
            cur += " " + s.rstrip("\\")
            if not s.endswith("\\"):
                where = f"{page.relative_to(REPO)}:{start}"
                # a lone "…" stands for more options; one inside a word for a value
                cur = re.sub(r"(^|\s)…(?=\s|$)", " ", cur).replace("…", "X")
                found.extend(Line(where, tuple(c)) for c in _split(cur))
                cur = None
    return found


def _is_ours(words: tuple[str, ...]) -> bool:
    return words[0] == "kvtool" or (
        words[0] == "python" and len(words) > 2 and words[1] == "-m"
        and words[2].split(".")[0] in ("kvtool", "emulator"))


LINES = [line for line in command_lines() if _is_ours(line.words)]


def test_the_pages_show_commands() -> None:
    assert len(LINES) > 30
    assert {line.where.split(":")[0] for line in LINES} >= {"docs/replay.md", "docs/audit.md"}


def test_the_splitter() -> None:
    assert _split("kvtool target up && kvtool replay t.jsonl  # note") == [
        ["kvtool", "target", "up"], ["kvtool", "replay", "t.jsonl"]]
    assert _split("A=1 kvtool pool status --json | jq -r .url") == [
        ["kvtool", "pool", "status", "--json"], ["jq", "-r", ".url"]]
    assert _split("python -m x --a 1 > out.txt &") == [["python", "-m", "x", "--a", "1"]]


def _parse(group: click.Command, info_name: str, args: list[str]) -> list[str]:
    """Parse ``args`` as the command line of ``group`` with click's parser (no value
    conversion); return the path of the command it reaches. Raises click's UsageError
    for an unknown command or option, a missing option value or an extra argument."""
    path: list[str] = []
    cmd, ctx = group, click.Context(group, info_name=info_name)
    while True:
        parser = cmd.make_parser(ctx)
        _, rest, _ = parser.parse_args(args=list(args))
        if not isinstance(cmd, click.Group):
            if rest:
                raise click.UsageError(f"extra arguments {rest} for {' '.join(path)}")
            return path
        if not rest:
            return path
        sub = cmd.get_command(ctx, rest[0])
        if sub is None:
            raise click.UsageError(f"no command {rest[0]!r} in {' '.join(path) or info_name}")
        path.append(rest[0])
        cmd, ctx, args = sub, click.Context(sub, info_name=rest[0], parent=ctx), rest[1:]


def _check_kvtool(line: Line) -> None:
    words = list(line.words)
    if words[0] == "kvtool":
        root: click.Command = cli
        args = words[1:]
    else:  # python -m kvtool.cli.target_alone
        assert words[2] == "kvtool.cli.target_alone", f"{line.where}: no module {words[2]}"
        root, args = target_alone, words[3:]
    try:
        path = _parse(root, "kvtool", args)
    except click.UsageError as exc:
        raise AssertionError(f"{line.where}: {line.text}: {exc.format_message()}") from None
    result = CliRunner().invoke(root, [*path, "--help"])
    assert result.exit_code == 0, f"{line.where}: {' '.join(path)} --help: {result.output}"


def _check_module(line: Line) -> None:
    module = line.words[2]
    rest = list(line.words[3:])
    sub = []
    for w in rest:  # sub-commands: the lower-case words before the first option
        if w.startswith("-") or not re.fullmatch(r"[a-z][a-z-]*", w):
            break
        sub.append(w)
    proc = subprocess.run([sys.executable, "-m", module, *sub, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{line.where}: python -m {module} {' '.join(sub)} --help: " \
                                 f"{proc.stderr[-2000:]}"
    missing = [w.split("=")[0] for w in rest if w.startswith("--")
               and w.split("=")[0] not in proc.stdout]
    assert not missing, f"{line.where}: {line.text}: no option {missing} in --help"


@pytest.mark.parametrize("line", [pytest.param(ln, id=f"{ln.where} {ln.text[:60]}")
                                  for ln in LINES])
def test_command_parses(line: Line) -> None:
    if line.words[0] == "kvtool" or line.words[2] == "kvtool.cli.target_alone":
        _check_kvtool(line)
    else:
        _check_module(line)


def runs(line: Line) -> bool:
    """Lines that need no root, no running target or pool, no network and no device."""
    w = line.words
    if w[0] != "kvtool":
        return False
    words = [x for x in w[1:] if x not in ("--json",)]
    if not words:
        return False
    if words[0] in ("plan", "trace") or words[:2] == ["experiment", "list"]:
        return True
    if words[0] == "audit":
        return "--device" not in words
    if words[0] == "replay":  # simulate mode, local traces
        return "--simulate" in words and not any("mooncake://" in x for x in words)
    if words[:2] == ["target", "keygen"]:
        return not any(x.startswith("/etc") for x in words)
    return False


RUNS = [line for line in LINES if runs(line)]


def test_runnable_lines_are_found() -> None:
    assert len(RUNS) > 10


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wd = tmp_path_factory.mktemp("docs")
    (wd / "fixtures").symlink_to(FIXTURES)
    (wd / "docs" / "img").mkdir(parents=True)
    trace = FIXTURES / "traces" / "multiturn-8x12.jsonl"
    for name in ("trace.jsonl", "mt.jsonl", "t.jsonl"):
        shutil.copy(trace, wd / name)
    (wd / "extents.csv").write_text("offset,length\n0,1048576\n1048576,1048576\n")
    for args in (["trace", "gen", "--sessions", "4", "--rounds", "6", "--input-tokens", "600",
                  "--output-tokens", "200", "--block-tokens", "512", "--format", "hash_ids",
                  "-o", str(wd / "mc512.jsonl")],
                 ["trace", "convert", str(wd / "mc512.jsonl"), "--to", "mooncake", "-o",
                  str(wd / "conversation_trace.jsonl")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
    return wd


@pytest.mark.slow
@pytest.mark.parametrize("line", [pytest.param(ln, id=f"{ln.where} {ln.text[:60]}")
                                  for ln in RUNS])
def test_command_runs(line: Line, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scratch)
    result = CliRunner(env={"KVTOOL_STATE_DIR": str(scratch / "state")}).invoke(
        cli, list(line.words[1:]))
    expected = 1 if "--strict" in line.words else 0  # audit --strict shows a failed check
    assert result.exit_code == expected, f"{line.where}: {line.text}\n{result.output[-3000:]}"


def test_every_python_m_module_the_pages_name_runs_as_a_program() -> None:
    """``python -m X`` anywhere in the pages (prose too) names a module that exists and runs
    as a program (a package with ``__main__``, or a module with a ``__main__`` block): a
    renamed module leaves no stale mention behind."""
    stale = []
    for page in [*PAGES, REPO / "BENCHMARKS.md"]:
        for n, text in enumerate(page.read_text().splitlines(), 1):
            for module in re.findall(r"python -m ([A-Za-z_][\w.]*\w)", text):
                base = REPO.joinpath(*module.split("."))
                if (base / "__main__.py").exists():
                    continue
                file = base.with_suffix(".py")
                if not (file.exists() and "__name__ == \"__main__\"" in file.read_text()):
                    stale.append(f"{page.relative_to(REPO)}:{n}: python -m {module}")
    assert not stale, "no such program: " + "; ".join(stale)
