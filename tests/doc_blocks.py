"""Run the code blocks of the Markdown documentation as tests, with Sybil.

Every fenced block of ``README.md``, ``docs/*.md`` and ``bench/README.md``
is a test, run in document order. Each page gets a fresh temporary
directory (the working directory of its blocks, removed afterwards; it holds
a copy of ``bench/``'s scripts, so ``python bench/step.py`` works as from a
checkout) and one Python namespace, so a page's blocks may build on each
other but never on another page or on an earlier run. How to mark a block is in
``tests/README.md``; in short:

- ``python``: run in the page's namespace (``>>>`` blocks are doctests, their
  output is checked);
- ``sh``: run with ``bash -e -o pipefail``; must exit 0;
- ``console``: a transcript. Each ``$ `` line (``\\`` continues it) is run in
  one bash session per block; what follows it, up to the next ``$ ``, is the
  expected output (stdout and stderr, as a terminal shows them), compared
  with doctest's ``ELLIPSIS``: ``...`` stands for any text, across lines;
- ``text``, ``json`` and the like: not run, unless a ``file(...)``
  directive saves them;
- a block without a language is an error: say what it is.

Directives are HTML comments just before a block (invisible on the rendered
page): Sybil's own ``<!-- skip: next "reason" -->``, and ours,
``<!-- docs-test: file("train.py") -->`` (save the block instead of running
it; a later block runs it), ``<!-- docs-test: reduce({"old": "new"},
reason="...") -->`` (run with these substitutions, in the code and in the
expected output) and ``<!-- docs-test: loose_numbers(reason="...") -->``
(numbers in the output may differ from the ones shown).

``python -m tests.doc_blocks`` prints how many blocks each page runs, runs
reduced, or skips (with the reasons).
"""

from __future__ import annotations

import ast
import doctest
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region, Sybil
from sybil.evaluators.doctest import DocTestEvaluator
from sybil.evaluators.python import pad
from sybil.parsers.abstract.doctest import DocTestStringParser
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/*.md", "bench/README.md")
BLOCK_TIMEOUT_S = 600  # one block (all of a console block's commands); the slowest runs ~40 s
SHELL_LANGUAGES = ("sh", "bash", "shell")
RUN_LANGUAGES = ("python", "console", *SHELL_LANGUAGES)

DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<call>.*?)\s*-->", re.DOTALL)
SKIP = re.compile(r"<!--\s*skip:\s*(?P<action>next|start|end)\b\s*(?P<reason>.*?)\s*-->", re.DOTALL)
FENCE_INFO = re.compile(r"(?P<language>[^\n]*)$\n", re.MULTILINE)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
STATUS_MARK = "\x1e"  # separates a console block's commands in the captured output
KILLED = re.compile(r"^bash: line \d+: +\d+ Killed\b.*$", re.MULTILINE)


# -- directives ------------------------------------------------------------------


@dataclass
class Directives:
    """What the comments before one block ask for."""

    file: str | None = None
    replace: dict[str, str] = field(default_factory=dict)
    reduce_reason: str | None = None
    loose_numbers: str | None = None

    def apply(self, text: str) -> str:
        for old, new in self.replace.items():
            text = text.replace(old, new)
        return text


def _literal(node: ast.AST, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{where}: arguments must be literals, got {ast.unparse(node)}") from None


def parse_directives(comments: list[str], where: str) -> Directives:
    """Read ``docs-test:`` calls such as ``reduce({"a": "b"}, reason="...")``.

    Example
    -------
    >>> parse_directives(['file("train.py")'], "here").file
    'train.py'
    """
    found = Directives()
    for text in comments:
        try:
            call = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise ValueError(f"{where}: cannot parse directive {text!r}") from None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            raise ValueError(f"{where}: a directive is a call such as file(\"x.py\"), got {text!r}")
        args = [_literal(a, where) for a in call.args]
        kwargs = {k.arg: _literal(k.value, where) for k in call.keywords}
        name = call.func.id
        if name == "file" and len(args) == 1 and not kwargs:
            found.file = str(args[0])
        elif name == "reduce" and len(args) == 1 and isinstance(args[0], dict) and set(kwargs) == {"reason"}:
            found.replace.update(args[0])
            found.reduce_reason = str(kwargs["reason"])
        elif name == "loose_numbers" and not args and set(kwargs) == {"reason"}:
            found.loose_numbers = str(kwargs["reason"])
        else:
            raise ValueError(
                f"{where}: unknown directive {text!r}; known: file(\"NAME\"), "
                "reduce({\"old\": \"new\"}, reason=\"...\"), loose_numbers(reason=\"...\")"
            )
    return found


# -- the blocks of a page ---------------------------------------------------------


@dataclass
class Block:
    """One fenced block, with what the comments before it say."""

    line: int
    language: str
    source: str
    directives: Directives
    skip: str | None  # the reason, when a skip directive covers this block
    region: Region

    @property
    def status(self) -> str:
        """``run``, ``reduced``, ``skipped``, ``saved`` (not code, written to a file) or ``text``.

        A block skipped only under a condition (``skip: next if(...)``) counts as run:
        the note names the condition.
        """
        if self.skip is not None and not self.skip.startswith("when "):
            return "skipped"
        if self.language not in RUN_LANGUAGES:
            return "saved" if self.directives.file else "text"
        return "reduced" if self.directives.reduce_reason else "run"


def _skip_reason(text: str) -> str:
    """The reason of ``skip: next "reason"``, or of ``skip: next if(condition, reason="...")``."""
    text = text.strip()
    try:
        if text.startswith("if"):
            call = ast.parse("f" + text[2:], mode="eval").body
            condition = ast.unparse(call.args[0])
            reason = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "reason"), condition)
            return f"when {condition}: {reason}"
        value = ast.literal_eval(text) if text else ""
    except (ValueError, SyntaxError, IndexError, StopIteration):
        value = text
    return str(value) or "(no reason given)"


def blocks(document: Document) -> list[Block]:
    """The page's fenced blocks in order, each with its directives."""
    lexer = RawFencedCodeBlockLexer(info_pattern=FENCE_INFO, mapping={"language": "language", "source": "source"})
    found: list[Block] = []
    previous_end = 0
    skipping: str | None = None
    for region in lexer(document):
        gap = document.text[previous_end : region.start]
        previous_end = region.end
        line = document.text.count("\n", 0, region.start) + 1
        where = f"{document.path}:{line}"
        skip_next = None
        for match in SKIP.finditer(gap):
            action, reason = match.group("action"), _skip_reason(match.group("reason"))
            if action == "next":
                skip_next = reason
            elif action == "start":
                skipping = reason
            else:
                skipping = None
        directives = parse_directives([m.group("call") for m in DIRECTIVE.finditer(gap)], where)
        language = region.lexemes["language"].strip().split()[0] if region.lexemes["language"].strip() else ""
        found.append(Block(line, language, str(region.lexemes["source"]), directives, skip_next or skipping, region))
    return found


# -- evaluation ------------------------------------------------------------------


def shell_env() -> dict[str, str]:
    """The environment of shell blocks: this interpreter's ``bin`` first, this checkout importable."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave as on a terminal
    return env


def _save(block: Block, text: str) -> None:
    Path(block.directives.file).write_text(text)


def evaluate_python(block: Block, example: Example) -> str | None:
    source = block.directives.apply(block.source)
    if block.directives.file:
        _save(block, source)
        return None
    # Padded so that tracebacks give the page's line numbers.
    code = compile(pad(source, example.line), example.path, "exec", dont_inherit=True)
    exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)
    return None


def evaluate_text(block: Block, example: Example) -> str | None:
    if block.directives.file:
        _save(block, block.directives.apply(block.source))
    return None


def evaluate_shell(block: Block, example: Example) -> str | None:
    source = block.directives.apply(block.source)
    if block.directives.file:
        _save(block, source)
        return None
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", source],
        capture_output=True, text=True, env=shell_env(), timeout=BLOCK_TIMEOUT_S, check=False,
    )
    if done.returncode != 0:
        return f"the block exited with status {done.returncode}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
    return None


@dataclass
class Command:
    text: str
    want: str


def parse_console(source: str) -> list[Command]:
    """Split a transcript into commands (``$ `` lines, ``\\`` continued) and their shown output.

    Example
    -------
    >>> [(c.text, c.want) for c in parse_console("$ echo a \\\\\\n  b\\na b\\n$ true\\n")]
    [('echo a \\\\\\n  b', 'a b\\n'), ('true', '')]
    """
    commands: list[Command] = []
    lines = source.splitlines()
    i = 0
    if lines and not lines[0].startswith("$ "):
        raise ValueError(f"a console block starts with a '$ ' command line, not {lines[0]!r}")
    while i < len(lines):
        text = [lines[i][2:]]
        while text[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            text.append(lines[i])
        i += 1
        want = []
        while i < len(lines) and not lines[i].startswith("$ "):
            want.append(lines[i])
            i += 1
        commands.append(Command("\n".join(text), "".join(w + "\n" for w in want)))
    return commands


def _normalise(text: str, *, loose_numbers: bool) -> str:
    text = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    if loose_numbers:
        text = NUMBER.sub("N", text)
    return text + "\n" if text else ""


def matches(want: str, got: str, *, loose_numbers: bool = False) -> bool:
    """Whether ``got`` is what ``want`` shows (``...`` stands for any text).

    Example
    -------
    >>> matches("step ...: loss 0.1\\n", "step 200: loss 0.1\\n"), matches("a\\n", "b\\n")
    (True, False)
    """
    want, got = _normalise(want, loose_numbers=loose_numbers), _normalise(got, loose_numbers=loose_numbers)
    return doctest.OutputChecker().check_output(want, got, doctest.ELLIPSIS)


def _console_script(commands: list[Command]) -> str:
    parts = ["exec 2>&1", "__status=0"]
    for i, command in enumerate(commands):
        # `(exit N)` puts the previous command's status back into $? (`$ echo $?` shows it).
        parts.append(f"printf '\\n{STATUS_MARK}begin {i}\\n'; (exit $__status)")
        parts.append(command.text)
        parts.append(f"__status=$?; printf '\\n{STATUS_MARK}end %d\\n' $__status")
    return "\n".join(parts) + "\n"


def run_console(commands: list[Command]) -> list[tuple[str, int | None]]:
    """Run the commands in one bash session; each one's output and exit status (None: never reached)."""
    done = subprocess.run(
        ["bash", "-c", _console_script(commands)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=shell_env(),
        timeout=BLOCK_TIMEOUT_S, check=False,
    )
    results: list[tuple[str, int | None]] = [("", None)] * len(commands)
    pattern = re.compile(rf"\n?{STATUS_MARK}begin (\d+)\n(.*?)\n?{STATUS_MARK}end (\d+)\n", re.DOTALL)
    for match in pattern.finditer(done.stdout):
        # What an interactive shell prints for a job killed by SIGKILL.
        output = KILLED.sub("Killed", match.group(2))
        results[int(match.group(1))] = (output, int(match.group(3)))
    return results


def evaluate_console(block: Block, example: Example) -> str | None:
    source = block.directives.apply(block.source)
    commands = parse_console(source)
    results = run_console(commands)
    loose = block.directives.loose_numbers is not None
    for i, (command, (got, status)) in enumerate(zip(commands, results)):
        if status is None:
            return f"$ {command.text}\ndid not finish: the shell exited during or before it"
        shows_status = (i + 1 < len(commands) and commands[i + 1].text.strip() == "echo $?") or bool(
            re.search(r"^Killed$", command.want, re.MULTILINE)
        )
        if status != 0 and not shows_status:
            return f"$ {command.text}\nexited with status {status}; its output:\n{got}"
        if not matches(command.want, got, loose_numbers=loose):
            return f"$ {command.text}\nshowed:\n{command.want}but printed:\n{got}"
    return None


def evaluate_untagged(block: Block, example: Example) -> str | None:
    return (
        "this block has no language: tag it (```console for a transcript with $ lines, ```sh for "
        "commands, ```python, or ```text for output and listings); see tests/README.md"
    )


EVALUATORS = {"python": evaluate_python, "console": evaluate_console, "": evaluate_untagged}
EVALUATORS.update(dict.fromkeys(SHELL_LANGUAGES, evaluate_shell))


class BlockParser:
    """A Sybil parser yielding one region per fenced block (doctest regions for ``>>>`` blocks)."""

    def __init__(self) -> None:
        self.doctests = DocTestStringParser(DocTestEvaluator(doctest.ELLIPSIS))

    def __call__(self, document: Document):
        for block in blocks(document):
            if block.language == "python" and block.source.lstrip().startswith(">>>") and not block.directives.file:
                source = block.region.lexemes["source"]
                for region in self.doctests(str(source), document.path):
                    region.adjust(block.region, source)
                    yield region
                continue
            evaluator = EVALUATORS.get(block.language, evaluate_text)

            def evaluate(example: Example, block: Block = block, evaluator=evaluator) -> str | None:
                __tracebackhide__ = True
                return evaluator(block, example)

            yield Region(block.region.start, block.region.end, block, evaluate)


# -- per-page directory -------------------------------------------------------------


def setup(namespace: dict[str, Any]) -> None:
    """A fresh directory for the page, made the working directory of its blocks."""
    import torch

    namespace["_docs_previous_cwd"] = os.getcwd()
    namespace["_docs_dir"] = tempfile.mkdtemp(prefix="tierstore-docs-")
    namespace["_gpu"] = torch.cuda.is_available()  # for `skip: next if(not _gpu, reason=...)`
    # The pages run bench scripts as from a checkout's root (`python bench/step.py ...`):
    # copies, so that nothing a block does can write into the repository.
    bench = Path(namespace["_docs_dir"]) / "bench"
    bench.mkdir()
    for script in [*ROOT.glob("bench/*.py"), *ROOT.glob("bench/*.sh")]:
        shutil.copy2(script, bench / script.name)
    os.chdir(namespace["_docs_dir"])


def teardown(namespace: dict[str, Any]) -> None:
    """Close what the page left open (optimizers hold locks and threads), leave and remove its directory."""
    from tierstore import TieredAdamW

    for value in list(namespace.values()):
        if isinstance(value, TieredAdamW):
            value.close()
    os.chdir(namespace.get("_docs_previous_cwd", ROOT))
    shutil.rmtree(namespace.get("_docs_dir", ""), ignore_errors=True)


def make_sybil() -> Sybil:
    """The Sybil that collects every page."""
    return Sybil(
        parsers=[BlockParser(), SkipParser()],
        patterns=list(PAGES),
        excludes=["tests/*"],
        path=str(ROOT),
        setup=setup,
        teardown=teardown,
    )


# -- inventory ---------------------------------------------------------------------


def inventory(root: Path = ROOT) -> dict[str, list[Block]]:
    """Every page's blocks, for the counts in the test report."""
    pages: dict[str, list[Block]] = {}
    for pattern in PAGES:
        for path in sorted(root.glob(pattern)):
            document = Document(path.read_text(), str(path))
            pages[str(path.relative_to(root))] = blocks(document)
    return pages


def format_inventory(pages: dict[str, list[Block]]) -> str:
    """A table: per page, the code blocks run, run reduced and skipped, and why."""
    lines = [f"{'page':40} {'run':>4} {'reduced':>8} {'skipped':>8}"]
    totals = {"run": 0, "reduced": 0, "skipped": 0}
    notes: list[str] = []
    for page, page_blocks in pages.items():
        counts = {"run": 0, "reduced": 0, "skipped": 0}
        for block in page_blocks:
            status = block.status
            if status not in counts or block.language not in RUN_LANGUAGES:
                continue
            counts[status] += 1
            if status == "reduced":
                notes.append(f"  {page}:{block.line} reduced: {block.directives.reduce_reason}")
            elif status == "skipped":
                notes.append(f"  {page}:{block.line} skipped: {block.skip}")
            if status != "skipped" and block.skip is not None:
                notes.append(f"  {page}:{block.line} skipped {block.skip}")
        for key in totals:
            totals[key] += counts[key]
        lines.append(f"{page:40} {counts['run']:>4} {counts['reduced']:>8} {counts['skipped']:>8}")
    lines.append(f"{'total':40} {totals['run']:>4} {totals['reduced']:>8} {totals['skipped']:>8}")
    return "\n".join(lines + notes)


if __name__ == "__main__":
    print(format_inventory(inventory()))
