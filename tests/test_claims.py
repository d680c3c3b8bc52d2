"""The numbers in README.md and docs/: every measured one backed by a current results row
(scripts/check_claims.py), README's results block as scripts/readme_table.py writes it and docs/quality.md's
as scripts/sweep_table.py writes it. All read the repository's git history (a row is current when the code it
measured is unchanged since its commit)."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

# The pathspecs that leave out the kernels a run of the dot interaction never imports
# (results_rows.INTERACTION_KERNELS).
NOT_DOT = tuple(
    f":(exclude){p}"
    for p in ("kernels/attention.py", "kernels/cross.py", "kernels/cross_hopper.py", "kernels/cross_net.py")
)


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import check_claims
    import results_rows

    return check_claims, results_rows


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True, cwd=REPO
    )


def test_every_number_in_the_docs_has_a_current_row():
    result = _run("check_claims.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_results_block_is_generated_from_the_rows():
    result = _run("readme_table.py", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_quality_sweep_block_is_generated_from_the_rows():
    result = _run("sweep_table.py", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_sweep_tables_show_seed_0_per_dataset_and_each_setting_over_its_seeds(scripts, monkeypatch):
    _, results_rows = scripts
    import generated_block
    import sweep_table

    monkeypatch.setattr(generated_block, "is_current", lambda row: row.cells["git_sha"] == "new")

    def run(line, label, window, seed, auc, loss, sha="new"):
        cells = {"label": label, "overrides": "", "window": window, "seed": seed, "val_auc": auc,
                 "val_ne": "0.9", "max_train_loss": loss, "base_loss": "0.5", "git_sha": sha}  # fmt: skip
        return results_rows.Row(sweep_table.SWEEP, line, cells)

    rows = [
        run(2, "a", "whole", "0", "0.70", "0.4"),
        run(3, "a", "whole", "1", "0.60", "0.6"),
        run(4, "a", "whole", "1", "0.80", "0.6"),  # seed 1 again: the newer run counts
        run(5, "b", "ctr", "0", "0.75", "0.4", sha="old"),
    ]
    seed0 = sweep_table.seed0_table(rows)
    assert seed0[0] == "| setting | overrides | ctr | whole | code changed since |"
    assert seed0[2] == "| a | (none) | - | 0.7000 / 0.9000 / 0.400 (L2) | no |"
    assert seed0[3] == "| b | (none) | 0.7500 / 0.9000 / 0.400 (L5) | - | yes |"
    seeds = sweep_table.seeds_table(rows)
    assert seeds[2:] == ["| a | whole | 0,1 | 0.7500 +- 0.0707 | 0.9000 +- 0.0000 | 1 | L2 L4 | no |"]


def test_claims_are_numbers_with_units_outside_code(scripts):
    check_claims, _ = scripts
    text = "\n".join(
        [
            "ours 25.5M samples/s, 1.3-2.2x the baseline, 0.74 / 0.07 ms, 4.5% idle, 3.1 TB/s",  # 1
            "a `1.9x` in backticks, 10 minutes, 157 B/row, 4 x 157 MB, lr 0.3",  # 2
            "",
            "    python bench.py --ratio 2.5x",  # 4: an indented code block
            "- a list item",
            "    whose continuation says 7.5x",  # 6: prose
            "test AUC 0.7364 and NE 0.934, seed 0.12",  # 7
            "```",
            "3.5x in a fence",
            "```",
            check_claims.BEGIN,
            "| 9.9x | generated |",
            check_claims.END,
        ]
    )
    found = [(c.line, c.text) for c in check_claims.find_claims("doc.md", text)]
    assert found == [
        (1, "25.5M"), (1, "1.3"), (1, "2.2"), (1, "0.74"), (1, "0.07"), (1, "4.5"), (1, "3.1"),
        (6, "7.5"), (7, "0.7364"), (7, "0.934"),
    ]  # fmt: skip
    claim = check_claims.find_claims("doc.md", "25.5M samples/s")[0]
    assert claim.value == 25.5e6 and claim.tolerance == pytest.approx(0.05e6)


def test_a_claim_is_backed_only_by_a_current_row_that_holds_it(scripts, monkeypatch):
    check_claims, results_rows = scripts
    rows = [
        results_rows.Row("train.csv", 2, {"git_sha": "old", "samples_per_s": "25526303", "idle": "0.0451"}),
        results_rows.Row("train.csv", 3, {"git_sha": "new", "samples_per_s": "13402744"}),
    ]
    monkeypatch.setattr(check_claims, "is_current", lambda row: row.cells["git_sha"] == "new")
    index = check_claims.RowIndex(rows)

    def backing(text):
        return index.backing_row(check_claims.find_claims("doc.md", text)[0])

    assert backing("13.4M samples/s") is rows[1]
    assert backing("13.5M samples/s") is None  # not in any row at its written precision
    assert backing("25.5M samples/s") is None  # in a row of code that has changed since
    monkeypatch.setattr(check_claims, "is_current", lambda row: True)
    assert backing("25.5M samples/s") is rows[0]
    assert backing("4.5% idle") is rows[0]  # a share held as a fraction


def test_cells_that_are_not_finite_numbers_hide_no_row(scripts, monkeypatch):
    """A NaN cell (an idle share a run could not measure) sorted among the values would leave the index
    out of order, and bisect would miss rows that hold a claim."""
    check_claims, results_rows = scripts
    monkeypatch.setattr(check_claims, "is_current", lambda row: True)
    cells = ["535.5", "12.0", "nan", "9000", "inf", "1.0", "700.0"]
    rows = [results_rows.Row("b.csv", line, {"us_per_step": cell}) for line, cell in enumerate(cells, 2)]
    index = check_claims.RowIndex(rows)
    for text in ("535.5 us", "12.0 us", "9000 us"):
        assert index.backing_row(check_claims.find_claims("doc.md", text)[0]) is not None, text


def test_code_tree_ignores_comments_and_docstrings_only(scripts):
    _, results_rows = scripts
    code = 'def f(x):\n    """Twice x."""\n    return 2 * x  # fast\n'
    reworded = 'def f(x):\n    """x doubled, as measured."""\n    # why: one multiply\n    return 2 * x\n'
    changed = 'def f(x):\n    """Twice x."""\n    return x + x\n'
    assert results_rows.code_tree(code) == results_rows.code_tree(reworded)
    assert results_rows.code_tree(code) != results_rows.code_tree(changed)


def test_a_commit_this_repository_lacks_is_never_current(scripts):
    _, results_rows = scripts
    assert not results_rows.commit_is_current("0000000", ("kernels",))
    assert not results_rows.commit_is_current("", ("kernels",))


def test_only_commits_in_heads_history_have_landed(scripts, monkeypatch, tmp_path):
    _, results_rows = scripts

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q", "-b", "main")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "base")
    base = git("rev-parse", "HEAD").strip()
    git("checkout", "-q", "-b", "branch")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "measured only")
    branch = git("rev-parse", "HEAD").strip()
    git("checkout", "-q", "main")
    monkeypatch.setattr(results_rows, "REPO", tmp_path)
    landed = results_rows.commit_landed.__wrapped__  # uncached: another repository
    assert landed(base) and landed(base[:7])
    assert not landed(branch)  # held here, but on a branch HEAD does not contain
    assert not landed("0000000") and not landed("")


def test_code_a_run_never_executed_leaves_its_row_current(scripts, monkeypatch, tmp_path):
    """The sharded model's code runs only on several ranks, the CUDA graphs' only on a GPU, the metrics' only
    in an evaluation: a change to the first leaves a one-process row current and ends a two-rank row, one to
    the second leaves a CPU row current and ends a GPU row, one to the third leaves a step benchmark's row
    current and ends a training run's; a change elsewhere in dlrm/ ends every row (a real git history)."""
    _, results_rows = scripts

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    for path in (
        *results_rows.SEVERAL_RANKS_ONLY,
        *results_rows.GPU_ONLY,
        "dlrm/metrics.py",
        "dlrm/model.py",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("X = 1\n")
    git("init", "-q", "-b", "main")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    base = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(results_rows, "REPO", tmp_path)

    def current(file="train.csv", **cells):
        row = results_rows.Row(file, 2, {"git_sha": base, "backend": "eager", **cells})
        is_current = results_rows.commit_is_current.__wrapped__  # uncached: the tree changes
        return is_current(base, results_rows.code_paths(row))

    assert current() and current(world_size="2") and current(device="cpu")
    (tmp_path / results_rows.SEVERAL_RANKS_ONLY[1]).write_text("X = 2\n")
    assert current() and current(world_size="1") and not current(world_size="2")
    (tmp_path / results_rows.GPU_ONLY[0]).write_text("X = 2\n")
    assert current(device="cpu") and not current(device="NVIDIA H200")
    (tmp_path / "dlrm" / "metrics.py").write_text("X = 2\n")
    assert current(device="cpu") and not current("quality.csv", device="cpu")
    (tmp_path / "dlrm" / "model.py").write_text("X = 2\n")
    assert not current(device="cpu")


def test_a_row_measures_the_config_file_it_names(scripts, monkeypatch):
    _, results_rows = scripts

    def row(config):
        return results_rows.Row("train.csv", 2, {"git_sha": "abc", "config": config})

    assert results_rows.config_path(row("kaggle")) == ("configs/kaggle.json",)
    assert results_rows.config_path(row("configs/main.json")) == ("configs/main.json",)
    assert results_rows.config_path(row("-")) == ()
    seen = []
    monkeypatch.setattr(results_rows, "commit_is_current", lambda sha, paths: seen.append(paths) or True)
    assert results_rows.is_current(row("kaggle"))
    one_process = tuple(f":(exclude){p}" for p in results_rows.SEVERAL_RANKS_ONLY)
    loop = (":(exclude)dlrm/run", ":(exclude)dlrm/metrics.py")
    assert seen == [(*results_rows.WHOLE, *NOT_DOT, *one_process, *loop, "configs/kaggle.json")]


def test_a_row_measures_only_its_own_interactions_kernels(scripts):
    """A run of the dot interaction never imports the cross network's or attention's kernels, a DCNv2 run
    never imports the dot interaction's: a change to one leaves the other's rows current. The interaction
    is the overrides' where they set it, else the config's; unknown (no config): every kernel counts."""
    _, results_rows = scripts

    def excluded(**cells):
        row = results_rows.Row(
            "quality.csv", 2, {"git_sha": "abc", "overrides": "train.use_triton=true", **cells}
        )
        paths = {
            p.removeprefix(":(exclude)") for p in results_rows.code_paths(row) if p.startswith(":(exclude)")
        }
        return {p for p in paths if p.startswith("kernels/")} - set(results_rows.SEVERAL_RANKS_ONLY)

    dot, dcn = (
        {"kernels/interaction.py"},
        {"kernels/cross.py", "kernels/cross_hopper.py", "kernels/cross_net.py"},
    )
    attention = {"kernels/attention.py"}
    assert excluded(config="configs/dlrm_dcnv2.json") == dot | attention
    assert excluded(config="configs/kaggle.json") == dcn | attention
    assert excluded(
        config="configs/kaggle.json", overrides='train.use_triton=true model.interaction="dcn"'
    ) == (dot | attention)
    assert excluded(
        config="configs/kaggle.json", overrides="train.use_triton=true model.interaction=cat"
    ) == (dot | dcn | attention)
    assert excluded(config="") == set()
    eager = results_rows.Row(
        "quality.csv", 2, {"git_sha": "abc", "config": "configs/kaggle.json", "overrides": ""}
    )
    assert "kernels" not in results_rows.code_paths(eager)  # no kernels at all: nothing to exclude


def test_a_row_measures_kernels_only_where_its_run_called_them(scripts):
    """A quality run of eager PyTorch does not measure kernels/ (a kernel change leaves it current); a
    --use-triton run or a triton step backend does, and so does --use-torch-compile on a GPU; rows that say
    nothing measure the whole application."""
    _, results_rows = scripts

    def row(file, **cells):
        return results_rows.Row(file, 2, {"git_sha": "abc", **cells})

    one_process = tuple(f":(exclude){p}" for p in results_rows.SEVERAL_RANKS_ONLY)
    dlrm_only, whole = ("dlrm", *one_process), (*results_rows.WHOLE, *one_process)
    assert results_rows.code_paths(row("quality.csv", config="configs/main.json", overrides="")) == dlrm_only
    overrides = 'train.use_triton=true data.loader="x"'
    triton = row("quality.csv", config="configs/kaggle.json", overrides=overrides)
    # kaggle.json's dot interaction: the other interactions' kernels are not run (NOT_DOT)
    assert results_rows.code_paths(triton) == (*results_rows.WHOLE, *NOT_DOT, *one_process)
    # A step benchmark runs no training loop and evaluates nothing: its row measures neither's code.
    no_metrics = (":(exclude)dlrm/run", ":(exclude)dlrm/metrics.py")
    assert results_rows.code_paths(row("train.csv", backend="eager")) == (*dlrm_only, *no_metrics)
    assert results_rows.code_paths(row("train.csv", backend="torch-graphed")) == (*dlrm_only, *no_metrics)
    assert results_rows.code_paths(row("train.csv", backend="triton+graphs")) == (*whole, *no_metrics)
    # --use-torch-compile on a GPU takes the whole-step graph, whose tables' state kernels/ makes
    graphed = row("train.csv", backend="compile+graphs", device="H200")
    assert results_rows.code_paths(graphed) == (*whole, *no_metrics)
    on_cpu = (*dlrm_only, *(f":(exclude){p}" for p in results_rows.GPU_ONLY))
    assert results_rows.code_paths(row("train.csv", backend="compile", device="cpu")) == (
        *on_cpu,
        *no_metrics,
    )
    compiled = 'train.use_torch_compile=true data.loader="x"'
    gpu = row("quality.csv", config="configs/kaggle.json", overrides=compiled, device="H200")
    assert results_rows.code_paths(gpu) == (*results_rows.WHOLE, *NOT_DOT, *one_process)
    cpu = row("quality.csv", config="configs/kaggle.json", overrides=compiled, device="cpu")
    assert results_rows.code_paths(cpu) == on_cpu
    assert results_rows.code_paths(row("breakdown.csv")) == whole
    several = row("train.csv", backend="triton+graphs", world_size="2")
    loop = tuple(f":(exclude){p}" for p in results_rows.LOOP_ONLY)
    assert results_rows.code_paths(several) == (*results_rows.WHOLE, *loop)
    assert results_rows.code_paths(row("checkpoint.csv", nproc="2")) == results_rows.WHOLE
    assert results_rows.code_paths(row("kernels.csv", backend="eager")) == ("kernels",)


def test_a_clocks_row_measures_its_workloads_code(scripts):
    """bench_clocks' workloads: our cross layer measures the cross kernels (as cross.csv), the torch GEMM and
    the compiled eager layer only the scripts that build them, the dlrm_dcnv2 step the whole application."""
    _, results_rows = scripts

    def clocks(workload):
        return results_rows.code_paths(
            results_rows.Row("clocks.csv", 2, {"git_sha": "abc", "workload": workload})
        )

    assert clocks("cross") == results_rows.MEASURES["cross.csv"]
    assert "kernels" not in clocks("gemm") and "dlrm" not in clocks("gemm")
    assert "kernels" not in clocks("cross-compile") and "scripts/bench_cross.py" in clocks("cross-compile")
    one_process = tuple(f":(exclude){p}" for p in results_rows.SEVERAL_RANKS_ONLY)
    assert clocks("dlrm_dcnv2") == (*results_rows.WHOLE, *one_process)


def test_step_table_names_the_tables_and_finds_the_fp32_baseline_of_bf16_tables(monkeypatch):
    """bf16 and fp32 tables of one setting are rows of their own, and a bf16-table row's baseline is the
    torch-graphed row of its invocation (fp32 tables) at the same table rows."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import readme_table
    from results_rows import Row

    monkeypatch.setattr(readme_table, "changed_since", lambda rows: "no")

    def row(line: int, backend: str, data: str, rate: int, run: str = "t1") -> Row:
        cells = {"date": run, "device": "H200", "git_sha": "abc1234", "config": "dlrm_dcnv2",
                 "precision": "bf16", "optimizer": "adagrad", "batch": "65536",
                 "table_rows_total": "22487036", "backend": backend, "data": data,
                 "samples_per_s": str(rate), "world_size": "1"}  # fmt: skip
        return Row("train.csv", line, cells)

    rows = [
        row(2, "torch-graphed", "random", 1_500_000),
        row(3, "triton+graphs", "random, bf16 tables", 3_000_000),
        row(4, "triton+graphs", "random", 2_400_000, run="t2"),
    ]
    table = "\n".join(readme_table.step_table(rows))
    assert "| 22.5M rows, bf16 | 3.00M | torch-graphed (one CUDA graph) | 1.50M | 2.00x |" in table
    assert "| 22.5M rows, fp32 | 2.40M | no graphed baseline in this run |" in table


def test_quality_table_keeps_a_labelled_setting_of_one_config_as_a_row_of_its_own(monkeypatch):
    """Two settings of one config on one dataset (another batch by --set, its own --label) are two rows, the
    label beside the config; neither hides the other as an older seed would."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import readme_table
    from results_rows import Row

    monkeypatch.setattr(readme_table, "changed_since", lambda rows: "no")

    def row(line: int, label: str, auc: str) -> Row:
        cells = {"window": "syn45m", "config": "configs/kaggle_large_batch.json", "label": label,
                 "seed": "0", "test_auc": auc, "test_ne": "0.73", "device": "H200",
                 "oracle_test_auc": "0.8608"}  # fmt: skip
        return Row("quality.csv", line, cells)

    rows = [row(2, "kaggle_large_batch", "0.8576"), row(3, "kaggle_large_batch_b131072", "0.8548")]
    table = "\n".join(readme_table.quality_table(rows))
    assert "| syn45m | configs/kaggle_large_batch.json | 0 | 0.8576 +- 0.0000 |" in table
    assert "| configs/kaggle_large_batch.json (kaggle_large_batch_b131072) | 0 | 0.8548 +- 0.0000 |" in table
