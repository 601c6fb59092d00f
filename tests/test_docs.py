"""The documentation, checked without Ray or the demo: the generated reference pages are what
the generator writes now, every relative link and ``#anchor`` resolves, every ``docs/...`` path
named in the text exists, every documented ``tokenrouter-ray`` command parses with the real
parser and every ``python -m loadtest...`` line names a real benchmark, and no page carries
words about how the project was made instead of what it does."""

from __future__ import annotations

import ast
import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tokenrouter_ray import docs_gen

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*\w\.(?:md|png|json|txt)\b")
# How or by whom the project was made, not what it does: none of it belongs in user docs.
PROCESS_WORDS = re.compile(
    r"\bRound \d+|\bround-\d+|(?<!-)\brounds? \d+(?:-\d+)?\b|DESIGN\.md|STYLE\.md|\.\./shared"
    r"|this workplace|\bof mine\b|\bwe measured\b|\bthis session\b|lent machine"
    r"|other engineers|other agents|device notes|\bissue \d+",
    re.I,
)


def split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code lines): fenced blocks are code; prose keeps its line positions
    (code lines are blanked in it) so headings inside code are never headings."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            prose.append("")
            continue
        (code if inside else prose).append(line)
        if inside:
            prose.append("")
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than ``-``
    and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or unicodedata.category(ch)[0] in "LN":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def without_inline_code(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


# ---- (a) generated pages -----------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(docs_gen.pages()), ids=str)
def test_generated_pages_are_current(path: Path) -> None:
    text = docs_gen.pages()[path]
    current = (ROOT / path).read_text() if (ROOT / path).exists() else None
    assert current == text, f"{path} is stale: run `python -m tokenrouter_ray.docs_gen`"


# ---- (b) links and paths -----------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_links_resolve(page: Path) -> None:
    prose, _ = split(page.read_text())
    broken = []
    for n, line in enumerate(prose, 1):
        for target in LINK.findall(without_inline_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"line {n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"line {n}: {target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_docs_paths_exist(page: Path) -> None:
    missing = sorted({p for p in DOC_PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names {missing}"


def test_every_docs_page_is_reachable_from_the_index() -> None:
    """Every page under docs/ is linked from docs/README.md or from a page it links to."""
    index = ROOT / "docs" / "README.md"
    seen, todo = {index}, [index]
    while todo:
        page = todo.pop()
        prose, _ = split(page.read_text())
        for target in LINK.findall(without_inline_code("\n".join(prose))):
            file = target.partition("#")[0]
            if not file or re.match(r"^[a-z][a-z0-9+.-]*:", file):
                continue
            dest = (page.parent / file).resolve()
            if dest.suffix == ".md" and dest.is_relative_to(ROOT / "docs") and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    orphans = sorted(str(p.relative_to(ROOT)) for p in PAGES if p not in seen)
    assert orphans == [str(Path("README.md"))], orphans


# ---- (c) documented commands -------------------------------------------------------------


def command_lines(page: Path) -> list[str]:
    """Shell lines of the page's fenced and indented code blocks: continuations joined, a
    leading ``$ `` and trailing comments dropped."""
    _, code = split(page.read_text())
    indented = [ln[4:] for ln in page.read_text().splitlines() if ln.startswith("    ")]
    lines = []
    for block in (code, indented):
        for line in "\n".join(block).replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            lines.append(re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip(" &"))
    return lines


def test_documented_cli_commands_parse() -> None:
    from tokenrouter_ray.cli import build_parser

    bad, count = [], 0
    for page in PAGES:
        for line in command_lines(page):
            if not line.startswith("tokenrouter-ray "):
                continue
            count += 1
            try:
                build_parser().parse_args(shlex.split(line)[1:])
            except SystemExit:
                bad.append(f"{page.relative_to(ROOT)}: {line}")
    assert count > 10
    assert not bad, "these do not parse with tokenrouter_ray.cli.build_parser:\n" + "\n".join(bad)


CHEAP_COMMANDS = ("tune", "plan", "config")  # seconds, no server, no model


def help_examples() -> list[tuple[Path, str]]:
    """The example lines of every command's help (its epilog), continuations joined."""
    import argparse

    from tokenrouter_ray.cli import build_parser

    found, pending = [], [build_parser()]
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += list(action.choices.values())
        for line in (parser.epilog or "").replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line.startswith("tokenrouter-ray "):
                found.append((ROOT / "tokenrouter_ray" / "cli.py", line))
    return found


def documented_commands() -> list[tuple[Path, str]]:
    """Every ``tokenrouter-ray ...`` command the pages show (code blocks and inline code) and
    every example in the commands' own help."""
    found = help_examples()
    for page in PAGES:
        inline = re.findall(r"`(tokenrouter-ray [^`]+)`", page.read_text())
        for line in [*command_lines(page), *inline]:
            if line.startswith("tokenrouter-ray "):
                found.append((page, line))
    return found


def test_documented_cheap_commands_run_as_written(monkeypatch, capsys) -> None:
    """The documented ``tune``, ``plan`` and ``config`` commands that need no file of the
    reader's own run as written (from the repository root) and succeed."""
    from tokenrouter_ray.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TOKENROUTER_OVERRIDES", raising=False)
    ran, bad = [], []
    for page, line in documented_commands():
        argv = shlex.split(line)[1:]
        if not argv or argv[0] not in CHEAP_COMMANDS or "..." in line or "-h" in argv:
            continue
        if len(argv) < (3 if argv[0] == "config" else 2):
            continue  # the command named in prose, not an example
        files = [a for a in argv if re.search(r"\.(json|ya?ml)$", a)]
        if any(not (ROOT / f).exists() for f in files):
            continue  # a file the reader makes first (a measured profile)
        ran.append(line)
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse refused it
            rc = exc.code
        if rc != 0:
            bad.append(f"{page.relative_to(ROOT)}: {line}: {capsys.readouterr().err.strip()}")
        capsys.readouterr()
    assert len(ran) >= 5, ran
    assert not bad, "\n".join(bad)


def loadtest_benchmarks() -> set[str]:
    """The names ``python -m loadtest <name>`` runs (read from the source: importing the
    harness is not needed to know them)."""
    tree = ast.parse((ROOT / "loadtest" / "__main__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "BENCHMARKS":
            return {ast.literal_eval(key) for key in node.value.keys}
    raise AssertionError("no BENCHMARKS in loadtest/__main__.py")


def test_documented_loadtest_commands_name_real_benchmarks() -> None:
    names = loadtest_benchmarks() | {"list"}
    bad, count = [], 0
    for page in PAGES:
        for line in command_lines(page):
            m = re.search(r"python3? -m (loadtest(?:\.[\w.]+)?)(?:\s+(\S+))?", line)
            if not m:
                continue
            count += 1
            module, first = m.groups()
            if module != "loadtest":
                path = ROOT / module.replace(".", "/")
                if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
                    bad.append(f"{page.relative_to(ROOT)}: {line} (no module {module})")
            elif first and not first.startswith("-") and first not in names:
                bad.append(f"{page.relative_to(ROOT)}: {line} (no benchmark {first})")
    assert count > 10
    assert not bad, "\n".join(bad)


# ---- (d) user documentation, not a lab notebook ------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_process_words(page: Path) -> None:
    hits = [
        f"line {n}: {m.group(0)!r}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in PROCESS_WORDS.finditer(line)
    ]
    assert not hits, f"{page.relative_to(ROOT)}:\n" + "\n".join(hits)


SOURCE_DIRS = (
    "tokenrouter_ray",
    "deployments",
    "conf",
    "scripts",
    "charts",
    "k8s",
    "loadtest",
    "tests",
)
SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".json", ".toml", ".txt", ".tpl"}


def test_no_process_words_in_code_or_comments() -> None:
    """Code, comments and configs say what and why, not when or by whom: no round or issue
    numbers, no files outside the repository (this file, which holds the pattern, aside)."""
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for folder in SOURCE_DIRS
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in SOURCE_SUFFIXES and path != Path(__file__) and path.is_file()
        and "results.json" not in path.name
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for m in PROCESS_WORDS.finditer(line)
    ]  # fmt: skip
    assert not hits, "\n".join(hits)


def test_github_slug() -> None:
    assert github_slug("The direct port (`directPort`)") == "the-direct-port-directport"
    assert github_slug("Sampling defaults (generation_config.json)") == (
        "sampling-defaults-generation_configjson"
    )
    assert github_slug("Quality: the speed–quality frontier") == (
        "quality-the-speedquality-frontier"
    )
