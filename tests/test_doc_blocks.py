"""The documentation tests' machinery (``tests/doc_blocks.py``) on small pages made here.

Each test writes a Markdown page into ``tmp_path``, runs its blocks as the
documentation run does (Sybil, the page's own directory and namespace) and
checks what passed, failed or was skipped, and why.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import SkipTest

import pytest
from sybil import Document
from sybil.example import SybilFailure
from sybil.parsers.markdown import SkipParser

from tests.doc_blocks import BlockParser, format_inventory, matches, parse_console, setup, teardown

FENCE = "```"


def run_page(tmp_path: Path, text: str, name: str = "page.md") -> list[tuple[str, str]]:
    """Run every block of a page; per Sybil example: ("ok" | "fail" | "skip", message)."""
    path = tmp_path / name
    path.write_text(text.replace("~~~", FENCE))
    document = Document.parse(str(path), BlockParser(), SkipParser())
    outcomes: list[tuple[str, str]] = []
    setup(document.namespace)
    try:
        for example in document.examples():
            try:
                example.evaluate()
                outcomes.append(("ok", ""))
            except SybilFailure as exc:
                outcomes.append(("fail", exc.result))
            except SkipTest as exc:
                outcomes.append(("skip", str(exc)))
    finally:
        teardown(document.namespace)
    return outcomes


def statuses(outcomes: list[tuple[str, str]]) -> list[str]:
    return [status for status, _ in outcomes]


def test_console_output_is_compared_with_ellipsis(tmp_path):
    page = """
~~~console
$ printf 'a\\nb 42\\nc\\n'
a
...
c
$ echo done
done
~~~

~~~console
$ echo something else
what the page claims
~~~
"""
    outcomes = run_page(tmp_path, page)
    assert statuses(outcomes) == ["ok", "fail"]
    assert "what the page claims" in outcomes[1][1] and "something else" in outcomes[1][1]


def test_console_failing_command_fails_unless_the_transcript_shows_its_status(tmp_path):
    page = """
~~~console
$ false
$ echo $?
1
~~~

~~~console
$ false
~~~

~~~console
$ bash -c 'kill -9 $$'
Killed
~~~
"""
    outcomes = run_page(tmp_path, page)
    assert statuses(outcomes) == ["ok", "fail", "ok"]
    assert "exited with status 1" in outcomes[1][1]


def test_untagged_block_fails_and_says_how_to_tag_it(tmp_path):
    outcomes = run_page(tmp_path, "~~~\n$ echo hi\n~~~\n")
    assert statuses(outcomes) == ["fail"]
    assert "```console" in outcomes[0][1]


def test_sh_block_must_exit_zero(tmp_path):
    outcomes = run_page(tmp_path, "~~~sh\ntrue\nfalse\necho never\n~~~\n\n~~~sh\necho fine\n~~~\n")
    assert statuses(outcomes) == ["fail", "ok"]


def test_file_directive_saves_a_block_that_a_later_block_runs(tmp_path):
    page = """
<!-- docs-test: file("hello.py") -->
~~~python
print("hello from a file")
~~~

~~~console
$ python hello.py
hello from a file
~~~
"""
    assert statuses(run_page(tmp_path, page)) == ["ok", "ok"]


def test_reduce_replaces_in_the_code_and_the_expected_output(tmp_path):
    page = """
<!-- docs-test: reduce({"1000000": "3"}, reason="a million lines take long") -->
~~~console
$ seq 1000000 | tail -n 1
1000000
~~~
"""
    assert statuses(run_page(tmp_path, page)) == ["ok"]


def test_loose_numbers_compares_the_words_only(tmp_path):
    page = """
<!-- docs-test: loose_numbers(reason="timings") -->
~~~console
$ echo "step 0.950 s, 12 reads"
step 0.123 s, 7 reads
~~~

<!-- docs-test: loose_numbers(reason="timings") -->
~~~console
$ echo "step 0.950 s, 12 writes"
step 0.123 s, 7 reads
~~~
"""
    assert statuses(run_page(tmp_path, page)) == ["ok", "fail"]


def test_skip_shows_its_reason(tmp_path):
    page = """
<!-- skip: next "needs a CUDA GPU" -->
~~~python
raise RuntimeError("must not run")
~~~
"""
    outcomes = run_page(tmp_path, page)
    assert ("skip", "needs a CUDA GPU") in outcomes


def test_python_blocks_of_a_page_share_a_namespace_and_doctests_check_output(tmp_path):
    page = """
~~~python
x = 6 * 7
~~~

~~~python
>>> x
42
~~~

~~~python
>>> x + 1
42
~~~
"""
    assert statuses(run_page(tmp_path, page)) == ["ok", "ok", "fail"]


def test_each_page_runs_in_its_own_fresh_directory_that_is_removed(tmp_path):
    before = os.getcwd()
    first = run_page(tmp_path, f"~~~sh\npwd > {tmp_path}/where.txt\ntouch left-behind\n~~~\n", name="a.md")
    second = run_page(tmp_path, "~~~sh\ntest ! -e left-behind\ntest -f bench/step.py\n~~~\n", name="b.md")
    assert statuses(first) == statuses(second) == ["ok"]
    assert os.getcwd() == before
    assert not Path((tmp_path / "where.txt").read_text().strip()).exists()


def test_unknown_directive_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown directive"):
        run_page(tmp_path, "<!-- docs-test: shrink(2) -->\n~~~sh\ntrue\n~~~\n")


def test_parse_console_joins_continued_lines():
    commands = parse_console("$ echo a \\\n    b\na b\n$ true\n")
    assert [(c.text, c.want) for c in commands] == [("echo a \\\n    b", "a b\n"), ("true", "")]


def test_matches_ignores_trailing_spaces_but_not_words():
    assert matches("a  \nb\n", "a\nb")
    assert not matches("a\nb\n", "a\nc\n")


def test_inventory_counts_run_reduced_and_skipped_blocks(tmp_path):
    from tests.doc_blocks import blocks

    page = tmp_path / "p.md"
    page.write_text(
        "~~~python\nx = 1\n~~~\n\n"
        "<!-- docs-test: reduce({'a': 'b'}, reason='long') -->\n~~~sh\necho a\n~~~\n\n"
        "<!-- skip: next \"needs a GPU\" -->\n~~~python\ny = 2\n~~~\n\n~~~text\nnot code\n~~~\n".replace("~~~", FENCE)
    )
    table = format_inventory({"p.md": blocks(Document(page.read_text(), str(page)))})
    assert "p.md" in table.splitlines()[1] and table.splitlines()[1].split()[1:] == ["1", "1", "1"]
    assert "reduced: long" in table and "skipped: needs a GPU" in table
