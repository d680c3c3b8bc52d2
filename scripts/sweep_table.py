"""Write docs/quality.md's table-optimizer sweep tables from scripts/results/recipe_sweep_tables.csv.

    python scripts/sweep_table.py [--check]

Rewrites the block between `<!-- results:begin -->` and `<!-- results:end -->` in docs/quality.md; `--check`
writes nothing and exits 1 when the block differs from what the rows give (CI runs it through
tests/test_claims.py). The rows are `scripts/quality.py --report val` runs, one per (setting, dataset, seed);
a setting is the row's `label` (its `overrides` say what it changes in the config).

- Seed 0: per setting, per dataset (the `window` column), val AUC / val NE / the largest logged training loss
  (`>` where it is above the split's base-rate loss), the row's line, and whether the code the settings ran
  on has changed since (scripts/results_rows.py's rule).
- Several seeds: per setting and dataset with more than one seed, the newest run of each seed, val AUC and NE
  as mean +- sd and the seeds whose training loss went above the base-rate loss.
"""

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_claims import BEGIN, END  # noqa: E402
from generated_block import changed_since, markdown_table, mean_sd, write_or_check  # noqa: E402
from results_rows import REPO, Row, read_rows  # noqa: E402

DOC = REPO / "docs" / "quality.md"
SWEEP = "recipe_sweep_tables.csv"


def _above_base(row: Row) -> bool:
    loss = row.cells.get("max_train_loss")
    return bool(loss) and float(loss) > float(row.cells["base_loss"])


def _cell(row: Row) -> str:
    """`AUC / NE / max loss` of one run, `>` after a loss above the base-rate loss, and its line."""
    loss = row.cells.get("max_train_loss")
    loss_text = f"{float(loss):.3f}{' >' if _above_base(row) else ''}" if loss else "-"
    return f"{float(row.cells['val_auc']):.4f} / {float(row.cells['val_ne']):.4f} / {loss_text} (L{row.line})"


def _newest_per_seed(rows: list[Row]) -> list[Row]:
    """The last row of each seed among `rows`, in seed order."""
    newest = {row.cells["seed"]: row for row in rows}
    return [newest[seed] for seed in sorted(newest, key=int)]


def seed0_table(rows: list[Row]) -> list[str]:
    """One line per setting (first-appearance order), one column per dataset, seed 0's newest run."""
    windows = sorted({row.cells["window"] for row in rows})
    labels = list(dict.fromkeys(row.cells["label"] for row in rows))
    body = []
    for label in labels:
        mine = [row for row in rows if row.cells["label"] == label and row.cells["seed"] == "0"]
        if not mine:
            continue
        newest = {row.cells["window"]: row for row in mine}
        overrides = mine[0].cells.get("overrides", "")
        body.append(
            [label, f"`{overrides}`" if overrides else "(none)",
             *(_cell(newest[w]) if w in newest else "-" for w in windows),
             changed_since(list(newest.values()))]
        )  # fmt: skip
    return markdown_table(["setting", "overrides", *windows, "code changed since"], body)


def seeds_table(rows: list[Row]) -> list[str]:
    """Settings and datasets run on more than one seed: val AUC and NE over the seeds."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.cells["label"], row.cells["window"]), []).append(row)
    body = []
    for (label, window), group in groups.items():
        runs = _newest_per_seed(group)
        if len(runs) < 2:
            continue
        above = [row.cells["seed"] for row in runs if _above_base(row)]
        body.append(
            [label, window, ",".join(row.cells["seed"] for row in runs),
             mean_sd([float(row.cells["val_auc"]) for row in runs]),
             mean_sd([float(row.cells["val_ne"]) for row in runs]), ",".join(above) or "none",
             " ".join(f"L{row.line}" for row in runs), changed_since(runs)]
        )  # fmt: skip
    header = ["setting", "data", "seeds", "val AUC", "val NE", "seeds above base-rate loss", "rows",
              "code changed since"]  # fmt: skip
    return markdown_table(header, body)


def block(rows: list[Row]) -> str:
    """The generated block, markers included."""
    rows = [row for row in rows if row.file == SWEEP]
    return "\n".join(
        [
            BEGIN,
            f"<!-- written by scripts/sweep_table.py from scripts/results/{SWEEP}: edit that, not this -->",
            "",
            "Seed 0, each cell val AUC / val NE / largest logged training loss (line of the row):",
            "",
            *seed0_table(rows),
            "",
            "Settings run on several seeds (the newest run of each seed):",
            "",
            *seeds_table(rows),
            END,
        ]
    )


@click.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the block is out of date.")
def main(check: bool) -> None:
    """Rewrite docs/quality.md's sweep tables from scripts/results/recipe_sweep_tables.csv."""
    write_or_check(DOC, lambda: block(read_rows()), "sweep_table.py", check)


if __name__ == "__main__":
    main()
