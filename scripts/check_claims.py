"""Check that every measured number in README.md and docs/*.md comes from a current scripts/results row.

    python scripts/check_claims.py [--list]

A claim is a number written with a unit of measurement: `x` right after the number (a ratio, `1.9x`), or
after a space or not: `us`, `ms`, `samples/s`, `rows/s`, `GB/s`, `TB/s`, `TFLOP/s`, `%`; numbers joined by
`-`, `/` or `to` before the unit (`1.3-2.2x`, `0.74 / 0.07 ms`) are claims each; `M`, `k` or `G` after a
number scales it (`25.5M samples/s`). So is a decimal with three or more digits after the point (`0.7364`)
on a line that names AUC, logloss or NE. Not claims: anything inside backticks, fenced code blocks or
indented code blocks (commands, config values, file names), numbers with other units (sizes, seconds,
counts), and the blocks that scripts/readme_table.py and scripts/sweep_table.py generate (between their
marker comments, built from the rows themselves).

A claim is backed when some current row (scripts/results_rows.py: measured on the code that is here now)
holds a cell equal to it at the precision it is written with (`25.5M` matches 25,526,303; `4.5%` matches
0.0451 or 4.51). It prints each claim that no current row backs, with its file and line, and exits 1 if there
is one; `--list` also prints the backed ones with the row (file:line) that backs each.
"""

import bisect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_rows import REPO, Row, is_current, read_rows  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NUMBER = r"\d[\d,]*(?:\.\d+)?[MkG]?"
UNIT = r"(?:(?<=[\d.MkG])x\b|\s?(?:us|ms|samples/s|rows/s|GB/s|TB/s|TFLOP/s)\b|\s?%)"
CLAIM = re.compile(rf"((?:{NUMBER}\s*(?:-|/|to)\s*)*{NUMBER}){UNIT}")
METRIC_LINE = re.compile(r"\b(?:AUC|logloss|NE)\b")
METRIC = re.compile(r"(?<![\d.])0\.\d{3,}\b")
SCALE = {"M": 1e6, "k": 1e3, "G": 1e9}
# A cell may hold the claim in another unit: a share as a fraction (4.5% as 0.045), ms as us.
CELL_SCALES = (1.0, 100.0, 1000.0, 0.001)


@dataclass(frozen=True)
class Claim:
    """A number as written in a doc: its file, line, text, value and half its last written digit."""

    path: str
    line: int
    text: str
    value: float
    tolerance: float


def _claim(path: str, line: int, text: str) -> Claim:
    scale = SCALE.get(text[-1], 1.0)
    digits = text.rstrip("MkG").replace(",", "")
    decimals = len(digits.partition(".")[2])
    return Claim(path, line, text, float(digits) * scale, 0.5 * 10.0**-decimals * scale)


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside code blocks and the generated block, inline code blanked."""
    lines, fenced, generated, indented, previous = [], False, False, False, ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        # An indented code block starts with an indented line after a blank one (a list item's indented
        # continuation lines are prose) and goes on while lines stay indented or blank.
        starts = line.startswith("    ") and (indented or not previous.strip())
        indented = starts or (indented and not stripped)
        previous = line
        if stripped.startswith("```"):
            fenced = not fenced
        elif stripped == BEGIN:
            generated = True
        elif stripped == END:
            generated = False
        elif not (fenced or generated or indented):
            lines.append((number, re.sub(r"`[^`]*`", "``", line)))
    return lines


def find_claims(path: str, text: str) -> list[Claim]:
    """Every claim (the module's rule) in the markdown `text` of `path`, in order."""
    claims = []
    for number, line in _prose(text):
        for match in CLAIM.finditer(line):
            for part in re.findall(NUMBER, match.group(1)):
                claims.append(_claim(path, number, part))
        if METRIC_LINE.search(line):
            claims.extend(_claim(path, number, m.group(0)) for m in METRIC.finditer(line))
    return claims


class RowIndex:
    """The numeric cells of `rows`, sorted by value (in each of `CELL_SCALES`): a claim's rows, fast."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        entries = []
        for index, row in enumerate(rows):
            for cell in row.cells.values():
                try:
                    value = float(cell)
                except (TypeError, ValueError):
                    continue
                if not math.isfinite(value):  # a NaN would unsort the list that bisect searches
                    continue
                entries.extend((value * scale, index) for scale in CELL_SCALES)
        entries.sort()
        self.values = [value for value, _ in entries]
        self.indices = [index for _, index in entries]

    def backing_row(self, claim: Claim) -> Row | None:
        """The first current row with a cell equal to `claim` at its written precision, or None."""
        slack = claim.tolerance * (1 + 1e-9)
        low = bisect.bisect_left(self.values, claim.value - slack)
        high = bisect.bisect_right(self.values, claim.value + slack)
        for index in sorted(set(self.indices[low:high])):
            if is_current(self.rows[index]):
                return self.rows[index]
        return None


def docs(repo: Path = REPO) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [repo / "README.md", *sorted((repo / "docs").glob("**/*.md"))]


@click.command()
@click.option("--list", "list_all", is_flag=True, help="Also print each backed claim and its row.")
def main(list_all: bool) -> None:
    """Fail (exit 1) on any number in README.md or docs/ that no current results row backs."""
    index = RowIndex(read_rows())
    unbacked = 0
    for doc in docs():
        relative = str(doc.relative_to(REPO))
        for claim in find_claims(relative, doc.read_text()):
            row = index.backing_row(claim)
            if row is None:
                unbacked += 1
                click.echo(f"{claim.path}:{claim.line}: {claim.text}: no current results row holds it")
            elif list_all:
                click.echo(f"{claim.path}:{claim.line}: {claim.text}: {row.key}")
    if unbacked:
        click.echo(
            f"{unbacked} claim(s) without a current row: measure again (scripts/bench_*.py) or remove them",
            err=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
