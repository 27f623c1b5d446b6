"""The README and every page under docs/ say only what holds: each relative link leads to
a file (and an #anchor to a heading of it), and each command a ```sh block shows that
runs one of the project's programs parses with that program's own argument parser
(`nodepulse-agent`, `nodepulse-operator`, `nodepulse-dev`, `python -m bench.X`, `python -m e2e.X`), or
names Makefile targets that exist (`make X`). No network, nothing is run: a program's
parser is the one its `main` builds, caught before it parses anything."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from nodeagent import config as agent_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted({ROOT / "README.md", ROOT / "charts" / "nodepulse" / "README.md",
                *(ROOT / "docs").rglob("*.md")})

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
SHELL_BLOCKS = {"sh", "bash", "shell"}
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PLACEHOLDER = re.compile(r"(?<![<\w])<[A-Za-z][\w .-]*>")  # <your registry>: one word
DUPLICATION = re.compile(r"(?<!\S)\d*[<>]&\d+(?!\S)")  # 2>&1
FD_NUMBER = re.compile(r"(?<!\S)\d+(?=[<>])")  # the 2 of 2>file
OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}
REDIRECTS = {"<", "<<", "<<<", ">", ">>", ">&", "<&", "&>", ">|"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the page's parts: prose lines (outside code blocks) and shell blocks --

def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence = ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.lstrip())
        if fence:
            if m and m.group(1).startswith(fence) and not m.group(2):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        yield n, line


def shell_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line number of the block's first line, its lines) for each sh/bash/shell block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].lstrip())
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].lstrip().startswith(m.group(1))), len(lines))
        if m.group(2) in SHELL_BLOCKS:
            yield i + 2, lines[i + 1:end]
        i = end + 1


# -- links --

def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors_in(text: str) -> set[str]:
    """The anchors of a page's headings (a repeated heading's get -1, -2, ...)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(text):
        if (m := HEADING.match(line)) is not None:
            base = slug(m.group(2))
            n = counts[base] = counts.get(base, -1) + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems_in(text: str, folder: Path, name: str) -> list[str]:
    """Links of a page that lies in folder whose file or heading does not exist."""
    problems = []
    for n, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        targets = [m.group(1) for m in LINK.finditer(line)]
        if (ref := REFERENCE.match(line)) is not None:
            targets.append(ref.group(1))
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # a URL (https:, mailto:): not the project's to check
            path_part, _, anchor = target.partition("#")
            where = f"{name}:{n}: link {target!r}"
            dest = (folder / path_part).resolve() if path_part else None
            if dest is not None and not dest.exists():
                problems.append(f"{where}: {path_part} does not exist")
            elif anchor and dest is not None and dest.suffix != ".md":
                problems.append(f"{where}: an anchor into {path_part}, which has no headings")
            elif anchor and anchor not in anchors_in(dest.read_text() if dest else text):
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


def link_problems(page: Path) -> list[str]:
    return link_problems_in(page.read_text(), page.parent, rel(page))


# -- commands --

class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
    raise _Built(self)


def main_parser(module: str) -> argparse.ArgumentParser:
    """The parser `python -m module` builds: its main() runs up to the moment it would
    parse the command line, and no further."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise LookupError(f"no module {module}")
    if spec.submodule_search_locations is not None:
        module += ".__main__"
    main = getattr(importlib.import_module(module), "main", None)
    if main is None:
        raise LookupError(f"{module} has no main()")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", _caught)
        mp.setattr(argparse.ArgumentParser, "parse_known_args", _caught)
        try:
            main()
        except _Built as built:
            return built.parser
    raise LookupError(f"{module}.main() parsed no command line")


def program_parser(name: str) -> argparse.ArgumentParser:
    if name == "nodepulse-agent":
        from nodeagent.cli import build_parser
        return build_parser()
    if name == "nodepulse-dev":
        from nodepulse_dev.__main__ import build_parser as dev_parser
        return dev_parser()
    from nodeoperator.cli import build_parser as operator_parser
    return operator_parser()


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in text.splitlines()
            if (m := re.match(r"^([\w.\- ]+):(?!=)", line))
            for t in m.group(1).split() if not t.startswith(".")}


def simple_commands(lines: list[str]) -> Iterator[list[str]]:
    """Each simple command of a shell block as its words: continuations joined,
    comments, heredoc bodies and redirections dropped, split at ; && || | &."""
    heredoc_end = None
    logical = ""
    for line in lines:
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        plain = FD_NUMBER.sub("", DUPLICATION.sub("", PLACEHOLDER.sub("PLACEHOLDER", logical)))
        lex = shlex.shlex(plain, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        words: list[str] = []
        skip = False
        for tok in lex:
            if skip:  # a redirection's file, or the word that ends a heredoc
                skip = False
            elif tok in OPERATORS:
                if words:
                    yield words
                words = []
            elif tok in REDIRECTS:
                skip = True
            else:
                words.append(tok)
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", logical)
        if m:
            heredoc_end = m.group(1)
        if words:
            yield words
        logical = ""


def parse_problem(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The parser's complaint about argv, or None if it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):  # --help and --version exit 0
            return err.getvalue().strip().splitlines()[-1]
    return None


def command_problem(words: list[str]) -> str | None:
    """What is wrong with one shown command, if it runs one of the project's programs."""
    env = []
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        env.append(words.pop(0).split("=", 1)[0])
    if not words:
        return None
    program, args = Path(words[0]).name, [w for w in words[1:] if w != "..."]
    if program in ("nodepulse-agent", "nodepulse-operator", "nodepulse-dev"):
        if program == "nodepulse-agent":
            flags = {agent_config.env_name(o.flag) for o in agent_config.OPTIONS if o.flag}
            unknown = [v for v in env if v.startswith(agent_config.ENV_PREFIX)
                       and v not in flags]
            if unknown:
                return f"{', '.join(unknown)}: no agent flag of that name"
        return parse_problem(program_parser(program), args)
    if re.fullmatch(r"python(3(\.\d+)?)?", program) and args[:1] == ["-m"] and len(args) > 1 \
            and re.match(r"^(bench|e2e|nodepulse_dev)\b", args[1]):
        try:
            parser = main_parser(args[1])
        except (LookupError, ImportError) as e:
            return str(e)
        return parse_problem(parser, args[2:])
    if program == "make":
        targets = make_targets()
        missing = [a for a in args if not a.startswith("-") and "=" not in a
                   and a not in targets]
        if missing:
            return f"no Makefile target {', '.join(missing)}"
    return None


def command_problems_in(text: str, name: str) -> list[str]:
    problems = []
    for first, lines in shell_blocks(text):
        for words in simple_commands(lines):
            problem = command_problem(list(words))
            if problem is not None:
                problems.append(f"{name}: the block at line {first}: "
                                f"`{shlex.join(words)}`: {problem}")
    return problems


# -- the tests --

@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_resolve(page: Path) -> None:
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_merge_conflict_is_left(page: Path) -> None:
    markers = [f"{rel(page)}:{i}" for i, line in enumerate(page.read_text().splitlines(), 1)
               if re.match(r"(<{7}|>{7}) |={7}$", line)]
    assert markers == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_shown_commands_parse(page: Path) -> None:
    assert command_problems_in(page.read_text(), rel(page)) == []


@pytest.mark.parametrize("command, complaint", [
    ("nodepulse-agent --node-name n1 --no-such-flag 3", "--no-such-flag"),
    ("NODEPULSE_NO_SUCH=1 nodepulse-agent --node-name n1", "NODEPULSE_NO_SUCH"),
    ("nodepulse-operator --kubeconfig k --metrics-prot 8080", "--metrics-prot"),
    ("python -m bench.scale --nodes 10 --minuets 1", "--minuets"),
    (".venv/bin/python -m nodepulse_dev upp", "upp"),
    ("nodepulse-dev up --virtual-nodez 5", "--virtual-nodez"),
    ("python -m e2e.conformance --onyl x", "--onyl"),
    ("python -m bench.nosuch --nodes 1", "bench.nosuch"),
    ("make run tset", "tset"),
])
def test_a_wrong_command_fails(command: str, complaint: str) -> None:
    page = f"# A page\n\n```sh\nls\n{command}   # a comment\n```\n"
    problems = command_problems_in(page, "page.md")
    assert len(problems) == 1 and complaint in problems[0], problems


def test_a_right_command_passes() -> None:
    page = ("```sh\n"
            "NODEPULSE_NODE_NAME=n1 nodepulse-agent ...\n"
            ".venv/bin/nodepulse-agent --virtual-nodes 3 --runtime fake \\\n"
            "  --enable-server=false &\n"
            "kubectl apply -f - <<'EOF'\n"
            "nodepulse-agent --not-a-command-but-yaml\n"
            "EOF\n"
            "python -m bench.scale --nodes 10 --minutes 1 && make run\n"
            "python -m nodepulse_dev up; nodepulse-operator --help\n"
            "nodepulse-agent --node-name-prefix <pod name>- --virtual-nodes 2 >log 2>&1\n"
            "```\n")
    assert command_problems_in(page, "page.md") == []


def test_a_broken_link_fails() -> None:
    page = ("# A page\n\n## Its `second` heading\n\n"
            "[ok](agent.md) [ok](pods.md#evented-pleg) [ok](#its-second-heading)\n"
            "[ok](benchmarks/) ![ok](benchmarks/scale.png) [web](https://example.com/x)\n"
            "[a](pods.md#no-such-heading) [b](nope.md) `[not a link](nope.md)`\n"
            "[c](#nowhere) [d](benchmarks/scale.png#x)\n"
            "```\n[in a code block](nope.md)\n```\n")
    problems = link_problems_in(page, ROOT / "docs", "page.md")
    assert [p.split(": ", 2)[1] for p in problems] == [
        "link 'pods.md#no-such-heading'", "link 'nope.md'", "link '#nowhere'",
        "link 'benchmarks/scale.png#x'"], problems
