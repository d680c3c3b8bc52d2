"""Write README.md's "what it achieves now" tables from scripts/results rows.

    python scripts/readme_table.py [--check]

Rewrites the block between `<!-- results:begin -->` and `<!-- results:end -->` in README.md; `--check`
writes nothing and exits 1 when the block differs from what the rows give (CI runs it through
tests/test_claims.py). Every table row names its machine, commit, config and batch, the baseline measured in
the same run, and whether the code it measured has changed since (scripts/results_rows.py's rule).

- Training step (results/train.csv, one GPU): per (config, precision, batch), the newest run with a
  `triton+graphs` row; its baseline is that run's `torch-graphed` row (the strongest plain-PyTorch step),
  else its `eager` row. Many GPUs: per (config, precision, batch per GPU, GPUs), the newest row of the
  config's own sharding; its baseline is the one-GPU row of the same commit and machine written just
  before it.
- The shipped sample (results/backends-val-test.csv): the newest run of each backend of main.json, against
  that run's `eager` row.
- Quality over seeds (results/quality.csv): per dataset and config, the newest run of each seed, mean and
  standard deviation of test AUC and NE, beside scikit-learn's L2 logistic regression on the same data and,
  on synthetic data, the planted model's test AUC (the best any model can score there).
"""

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_claims import BEGIN, END  # noqa: E402
from generated_block import changed_since, markdown_table, mean_sd, write_or_check  # noqa: E402
from results_rows import REPO, Row, commit_landed, history_available, read_rows  # noqa: E402

README = REPO / "README.md"


def _millions(value: str) -> str:
    return f"{float(value) / 1e6:.2f}M"


def _ratio(ours: Row, base: Row | None) -> str:
    """samples/s of `ours` over `base`'s, as `1.23x`; empty without a base."""
    return f"{float(ours.cells['samples_per_s']) / float(base.cells['samples_per_s']):.2f}x" if base else ""


def _run(row: Row) -> tuple[str, str, str]:
    return row.cells["date"], row.cells["device"], row.cells["git_sha"]


# Like with like: our graphed step against plain PyTorch's step as one CUDA graph (an eager step launched
# from Python would measure launch overhead, not the kernels).
BASELINES = {"torch-graphed": "torch-graphed (one CUDA graph)"}


def _tables(row: Row) -> str:
    """The tables a train.csv row trained: total rows and dtype, e.g. "22.5M rows, bf16" (bench_train names
    bf16 tables in the data column; fp32 otherwise)."""
    rows = row.cells.get("table_rows_total") or ""
    dtype = "bf16" if "bf16 tables" in row.cells.get("data", "") else "fp32"
    return f"{int(rows) / 1e6:.1f}M rows, {dtype}" if rows else dtype


def _setting(row: Row) -> tuple[str, str, str, str, str]:
    """(config, precision, optimizer, batch, tables) of a train.csv row (rows before the optimizer column:
    SGD)."""
    cells = row.cells
    return cells["config"], cells["precision"], cells.get("optimizer") or "sgd", cells["batch"], _tables(row)


def _same_run(rows: list[Row], ours: Row) -> dict[str, Row]:
    """The rows of `ours`'s invocation (same date, machine, commit) at its config, precision, optimizer, batch
    and table rows (the baseline's tables are fp32 whatever ours are)."""
    return {
        r.cells["backend"]: r
        for r in rows
        if _run(r) == _run(ours)
        and _setting(r)[:4] == _setting(ours)[:4]
        and r.cells.get("table_rows_total") == ours.cells.get("table_rows_total")
    }


def step_table(rows: list[Row]) -> list[str]:
    """One GPU: triton+graphs samples/s per (config, precision, optimizer, batch, tables) against the same
    run's baseline, from the newest run that measured a baseline (else the newest run)."""
    rows = [r for r in rows if r.file == "train.csv" and r.cells.get("world_size", "1") in ("", "1")]
    newest: dict[tuple[str, str, str, str, str], Row] = {}
    for row in rows:
        if row.cells["backend"] != "triton+graphs":
            continue
        key = _setting(row)
        has_base = any(name in _same_run(rows, row) for name in BASELINES)
        if has_base or key not in newest or not any(n in _same_run(rows, newest[key]) for n in BASELINES):
            newest[key] = row
    body = []
    for (config, precision, optimizer, batch, tables), ours in sorted(
        newest.items(), key=lambda kv: (kv[0][:3], int(kv[0][3]), kv[0][4])
    ):
        same = _same_run(rows, ours)
        name = next((n for n in BASELINES if n in same), None)
        base = same[name] if name else None
        base_rate = _millions(base.cells["samples_per_s"]) if base else ""
        body.append(
            [config, precision, optimizer, f"{int(batch):,}", tables, _millions(ours.cells["samples_per_s"]),
             BASELINES[name] if name else "no graphed baseline in this run", base_rate, _ratio(ours, base),
             ours.cells["device"], changed_since([ours]), ours.key]
        )  # fmt: skip
    header = ["config", "precision", "optimizer", "batch", "tables", "ours samples/s", "baseline",
              "baseline samples/s", "ratio", "machine", "code changed since", "row"]  # fmt: skip
    return markdown_table(header, body)


def scaling_table(rows: list[Row]) -> list[str]:
    """Many GPUs: the newest row per (config, precision, batch per GPU, GPUs) with the config's own sharding
    (not a `--shardings` variant, which bench_train names in the data column) against its one-GPU row."""
    rows = [
        r
        for r in rows
        if r.file == "train.csv"
        and r.cells.get("backend") == "triton+graphs"
        and ", sharding " not in r.cells.get("data", "")
    ]
    newest: dict[tuple[str, str, str, str], tuple[int, Row]] = {}
    for position, row in enumerate(rows):
        if row.cells.get("world_size", "1") not in ("", "1"):
            key = (row.cells["config"], row.cells["precision"], row.cells["batch"], row.cells["world_size"])
            newest[key] = (position, row)
    body = []
    for (config, precision, batch, world), (position, ours) in sorted(newest.items()):
        before = [
            r
            for r in rows[:position]
            if r.cells.get("world_size", "1") in ("", "1")
            and (r.cells["config"], r.cells["precision"], r.cells["batch"]) == (config, precision, batch)
            and (r.cells["device"], r.cells["git_sha"]) == (ours.cells["device"], ours.cells["git_sha"])
        ]
        base = before[-1] if before else None
        base_rate = _millions(base.cells["samples_per_s"]) if base else ""
        # Empty where the run had no one-GPU step to compare with (e.g. tables that fit no single GPU).
        scaling = ours.cells["scaling_vs_1gpu"] and f"{float(ours.cells['scaling_vs_1gpu']):.2f}x"
        body.append(
            [config, precision, f"{int(batch):,}", world, _millions(ours.cells["samples_per_s"]), base_rate,
             scaling, ours.cells["device"], changed_since([ours]), ours.key]
        )  # fmt: skip
    header = ["config", "precision", "batch per GPU", "GPUs", "samples/s", "1 GPU samples/s", "scaling",
              "machine", "code changed since", "row"]  # fmt: skip
    return markdown_table(header, body)


def sample_table(rows: list[Row]) -> list[str]:
    """main.json on the shipped sample: each backend's newest run against that run's eager row."""
    rows = [r for r in rows if r.file == "backends-val-test.csv"]
    newest = {r.cells["backend"]: r for r in rows}
    body = []
    for backend, ours in newest.items():
        eager = next((r for r in rows if _run(r) == _run(ours) and r.cells["backend"] == "eager"), None)
        body.append(
            [backend, ours.cells["config"], ours.cells["batch"], f"{float(ours.cells['val_auc']):.4f}",
             f"{float(ours.cells['test_auc']):.4f}", f"{float(ours.cells['samples_per_s']):,.0f}",
             _ratio(ours, eager), ours.cells["device"], changed_since([ours]), ours.key]
        )  # fmt: skip
    header = ["backend", "config", "batch", "val AUC", "test AUC", "samples/s", "vs eager (same run)",
              "machine", "code changed since", "row"]  # fmt: skip
    return markdown_table(header, body)


def _latest_seeds(runs: list[Row]) -> list[Row]:
    """The newest run of each seed among `runs` (in file order), back to the first seed that repeats."""
    picked: dict[str, Row] = {}
    for row in reversed(runs):
        if row.cells["seed"] in picked:
            break
        picked[row.cells["seed"]] = row
    return sorted(picked.values(), key=lambda r: r.line)


def _planted(runs: list[Row]) -> str:
    """The planted model's test AUC on synthetic data (its `oracle_test_auc`: the best any model can score
    there, the same for every seed); "-" where the rows record none (real data has no planted model)."""
    cells = {r.cells.get("oracle_test_auc") or "" for r in runs}
    return f"{float(cells.pop()):.4f}" if cells != {""} and len(cells) == 1 else "-"


def quality_table(rows: list[Row]) -> list[str]:
    """Test AUC and NE over seeds per dataset (the `window` column: a window of the sample or a data
    directory), config and label (a label other than the config's name marks a run with its own overrides,
    shown beside the config), the newest run of each seed, beside scikit-learn's val-tuned L2 logistic
    regression on the same data (`scripts/quality.py --sklearn`) where measured."""
    rows = [r for r in rows if r.file == "quality.csv" and r.cells.get("window")]
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.cells["window"], row.cells["config"], row.cells["label"]), []).append(row)
    body = []
    for (window, config, label), group in groups.items():
        if config == "sklearn_l2":
            continue
        runs = _latest_seeds(group)
        reference = _latest_seeds(groups.get((window, "sklearn_l2", "sklearn_l2"), []))
        if label != Path(config).stem:  # a setting of its own (overrides), e.g. another batch or table dtype
            config = f"{config} ({label})"
        ref_auc, ref_ne = (
            (mean_sd([float(r.cells[f"test_{m}"]) for r in reference]) for m in ("auc", "ne"))
            if reference
            else ("not measured", "not measured")
        )
        body.append(
            [window, config, ",".join(r.cells["seed"] for r in runs),
             mean_sd([float(r.cells["test_auc"]) for r in runs]),
             mean_sd([float(r.cells["test_ne"]) for r in runs]), ref_auc, ref_ne, _planted(runs),
             runs[0].cells["device"], changed_since(runs),
             f"{runs[0].key}-{runs[-1].line}" if len(runs) > 1 else runs[0].key]
        )  # fmt: skip
    header = ["data", "config", "seeds", "test AUC", "test NE", "L2 LR test AUC (same data)", "L2 LR test NE",
              "planted model's test AUC", "machine", "code changed since", "rows"]  # fmt: skip
    return markdown_table(header, body)


def block(rows: list[Row]) -> str:
    """The generated block, markers included, from the rows of commits that landed (all rows where the
    history is missing and landing cannot be told)."""
    if history_available():
        rows = [r for r in rows if commit_landed(r.cells.get("git_sha", ""))]
    parts = [
        BEGIN,
        "<!-- written by scripts/readme_table.py from scripts/results/*.csv: edit those, not this -->",
        "",
        "Training step, one GPU (`scripts/bench_train.py`, GPU-resident random batches; the tables column: "
        "their rows in total and dtype):",
        "",
        *step_table(rows),
        "",
        "Training step, many GPUs (the same script with `--nproc`; scaling = samples/s over one GPU's):",
        "",
        *scaling_table(rows),
        "",
        "configs/main.json on the shipped sample, per backend (`scripts/compare_backends.py`, seed 0):",
        "",
        *sample_table(rows),
        "",
        "Quality over seeds (`scripts/quality.py --report test`; data: a window of the shipped sample or a "
        "`--data` directory):",
        "",
        *quality_table(rows),
        END,
    ]
    return "\n".join(parts)


@click.command()
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if README.md's block is out of date.")
def main(check: bool) -> None:
    """Rewrite README.md's results block from scripts/results/*.csv."""
    write_or_check(README, lambda: block(read_rows()), "readme_table.py", check)


if __name__ == "__main__":
    main()
