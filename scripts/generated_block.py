"""A markdown file's generated block: the text between `<!-- results:begin -->` and `<!-- results:end -->`
that a script writes from scripts/results rows (scripts/readme_table.py for README.md, scripts/sweep_table.py
for docs/quality.md), and what those scripts share: the table layout, mean +- sd, the "code changed since"
cell, and write-or-check."""

import re
import statistics
import sys
from pathlib import Path

import click
from check_claims import BEGIN, END
from results_rows import REPO, Row, history_available, is_current


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """The lines of a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def mean_sd(values: list[float]) -> str:
    """`mean +- sd` at 4 decimals (sd 0 for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} +- {sd:.4f}"


def changed_since(rows: list[Row]) -> str:
    """The "code changed since" cell of `rows`: "yes" when any of them is not current, else "no"."""
    return "yes" if any(not is_current(row) for row in rows) else "no"


def without_currency(text: str) -> str:
    """`text` with every "code changed since" cell (a lone yes or no) made the same."""
    return re.sub(r"\| (yes|no) \|", "| ? |", text)


def replace_block(text: str, block: str, name: str) -> str:
    """`text` with its block between the markers replaced by `block` (markers included). Raises ValueError,
    naming the file `name`, without both markers in order."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{name}: expected the markers {BEGIN} and {END}, in that order")
    return text[:start] + block + text[end + len(END) :]


def write_or_check(path: Path, make_block, script: str, check: bool) -> None:
    """Rewrite `path`'s block as `make_block()` gives it, or with `check` write nothing and exit 1 when it
    differs. Without the git history the "code changed since" cells cannot be computed, so then they are
    left out of the comparison."""
    name = str(path.relative_to(REPO))
    text = path.read_text()
    try:
        new = replace_block(text, make_block(), name)
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    if not check:
        path.write_text(new)
        return
    if not history_available():
        click.echo("a shallow clone or no git: the 'code changed since' column is not checked", err=True)
        new, text = without_currency(new), without_currency(text)
    if new != text:
        click.echo(f"{name}: the results block is out of date: run scripts/{script}", err=True)
        sys.exit(1)
