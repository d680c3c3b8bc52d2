"""The rows of scripts/results/*.csv, and whether each is current: measured on the code that is here now.

The rule for "current": a row is current when its `git_sha` names a commit of this repository and the code
it measures has not changed since that commit (`code_paths`: its file's `MEASURES` entry, else the whole
application, less kernels/ for a run that never called them and the other interactions' kernels for one
that did, the sharded model's code for a run of one
process and the CUDA graphs' for a run on the CPU), nor the config file its `config` cell names
(`configs/NAME.json` for a bare name, as the bench scripts read it, or the path itself): a run of
`configs/main.json` measures that file's settings too. A change is any difference in a
non-Python file, or a Python file whose syntax tree differs once docstrings are dropped (comments are not
in the tree), so rewording a comment or a docstring keeps a measurement current and any code change ends it.
The comparison is against the working tree, so uncommitted code counts too. Rows without a `git_sha`, or
whose commit this repository does not hold (a shallow clone, a copy without git), are never current.
"""

import ast
import csv
import json
import re
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "scripts" / "results"

# The code each results file measures (paths relative to the repository root). A file not listed here
# measures the whole application.
WHOLE = ("dlrm", "kernels")
# Code that only a run of several ranks executes (dlrm.run.strategy's Sharded builds the sharded model, and
# nothing else imports these, kernels.table_order only the sharded model; one process imports
# dlrm.parallel.evaluation and, through dlrm.parallel.checkpoint, dlrm.parallel.planner for types, but only
# Sharded makes a plan, makes the evaluation's split and calls it): a one-process row did not measure it.
SEVERAL_RANKS_ONLY = (
    "dlrm/parallel/planner.py",
    "dlrm/parallel/sharded.py",
    "dlrm/parallel/sharded_bags.py",
    "dlrm/parallel/evaluation.py",
    "kernels/table_order.py",
)
# Code that only a training run executes, its loop and evaluations, which a training-step benchmark never
# runs (scripts/bench_train.py times steps on random batches and imports nothing of dlrm.run): a row of
# STEP_BENCHMARKS did not measure it.
LOOP_ONLY = ("dlrm/run", "dlrm/parallel/evaluation.py", "dlrm/metrics.py")
STEP_BENCHMARKS = ("train.csv",)
# Code that only a run on a CUDA GPU executes (CUDA graphs: dlrm.config refuses train.cuda_graphs elsewhere):
# a CPU row did not measure it.
GPU_ONLY = ("dlrm/graphs.py",)
# Each interaction's own kernels, imported only by a model whose model.interaction names it
# (dlrm.model.dlrm.InteractionArch, dlrm.model.dcn): a row of another interaction did not run them.
INTERACTION_KERNELS: dict[str, tuple[str, ...]] = {
    "dot": ("kernels/interaction.py",),
    "attention": ("kernels/attention.py",),
    "dcn": ("kernels/cross.py", "kernels/cross_hopper.py", "kernels/cross_net.py"),
}
MEASURES: dict[str, tuple[str, ...]] = {
    "preprocess.csv": ("dlrm/data",),
    "loader.csv": ("dlrm/data",),
    "kernels.csv": ("kernels",),
    "blocks.csv": ("kernels",),
    "lora.csv": ("kernels",),
    "mlp.csv": ("kernels",),
    "sparse.csv": ("kernels",),
    "linear_act_backward.csv": ("kernels",),
    # One cross layer or network (scripts/bench_cross.py), eager, compiled and ours: the cross kernels and
    # the modules they import, none of the other ops'.
    "cross.csv": (
        "kernels/__init__.py",
        "kernels/cross.py",
        "kernels/cross_hopper.py",
        "kernels/cross_net.py",
        "kernels/gemm",
        "kernels/launch.py",
        "kernels/op.py",
    ),
    # The bag lookup and its fused updates on their own (scripts/bench_embedding_bag.py): the bag kernels, the
    # modules they import and the bags' maker, none of the other ops'.
    **dict.fromkeys(
        ("embedding_bag.csv", "embedding_bag_kernels.csv"),
        (
            "kernels/__init__.py",
            "kernels/adagrad.py",
            "kernels/embedding.py",
            "kernels/embedding_bag.py",
            "kernels/embedding_bag_update.py",
            "kernels/embedding_update.py",
            "kernels/launch.py",
            "kernels/multi_tensor.py",
            "kernels/op.py",
            "dlrm/choices.py",
            "dlrm/data/bags.py",
            "dlrm/data/schema.py",
            "dlrm/data/synthetic_rows.py",
        ),
    ),
    # The planted model and the tables' rows, computed on the CPU: no training, no kernels.
    "hashing_ceiling.csv": (
        "dlrm/data",
        "dlrm/model/tables.py",
        "dlrm/config.py",
        "dlrm/config_sections.py",
        "scripts/hashing_ceiling.py",
    ),
}


# The code each workload of clocks.csv (scripts/bench_clocks.py) runs: the torch GEMM of the ceiling,
# torch.compile of bench_cross's eager layer, our cross layer (cross.csv's code), the dlrm_dcnv2 step (the
# whole application). The GEMM and the compiled layer run no code of dlrm/ or kernels/: their rows measure the
# scripts that build them.
CLOCKS_WORKLOADS: dict[str, tuple[str, ...]] = {
    "gemm": ("scripts/bench_clocks.py", "scripts/bench_timing.py"),
    "cross-compile": ("scripts/bench_clocks.py", "scripts/bench_cross.py"),
    "cross": MEASURES["cross.csv"],
}


@dataclass(frozen=True)
class Row:
    """One CSV row: its file's name, its 1-based line in that file, and its cells as read (strings)."""

    file: str
    line: int
    cells: dict[str, str]

    @property
    def key(self) -> str:
        """How docs name the row: file and line (`train.csv:57`)."""
        return f"{self.file}:{self.line}"


def read_rows(results: Path = RESULTS) -> list[Row]:
    """Every row of every `*.csv` under `results`, in file order."""
    rows = []
    for path in sorted(results.glob("*.csv")):
        with path.open(newline="") as f:
            for line, cells in enumerate(csv.DictReader(f), start=2):
                rows.append(Row(path.name, line, cells))
    return rows


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def code_tree(source: str) -> str:
    """`source`'s syntax tree without docstrings (no comments, no line numbers), as comparable text.
    Raises SyntaxError for text that is not Python."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _same_code(commit: str, path: str) -> bool:
    """Whether `path` holds the same code at `commit` as in the working tree (see the module's rule)."""
    here = REPO / path
    try:
        then = _git("show", f"{commit}:{path}")
    except subprocess.CalledProcessError:
        return False  # added since
    if not here.exists() or not path.endswith(".py"):
        return False  # removed since, or a non-Python file that differs
    try:
        return code_tree(then) == code_tree(here.read_text())
    except SyntaxError:
        return False


@cache
def commit_is_current(commit: str, paths: tuple[str, ...]) -> bool:
    """Whether the code under `paths` is unchanged (by the module's rule) since `commit`; False when this
    repository does not hold `commit`."""
    if not commit:
        return False
    try:
        full = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").strip()
    except (subprocess.CalledProcessError, OSError):  # not a commit here, or no repository or git at all
        return False
    changed = _git("diff", "--name-only", full, "--", *paths).split()
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *paths).split()
    return not untracked and all(_same_code(full, path) for path in changed)


@cache
def commit_landed(commit: str) -> bool:
    """Whether `commit` is HEAD or one of its ancestors; False when this repository does not hold it. A row
    measured on a branch that never landed (kept as the evidence for not taking it) measured code the
    product does not have."""
    if not commit:
        return False
    try:
        _git("merge-base", "--is-ancestor", commit, "HEAD")
    except (subprocess.CalledProcessError, OSError):  # not an ancestor, not a commit here, or no git
        return False
    return True


def history_available() -> bool:
    """Whether this is a git repository with its whole history (not a shallow clone): what `is_current`
    needs to tell a current row from an old one."""
    try:
        return _git("rev-parse", "--is-shallow-repository").strip() == "false"
    except (subprocess.CalledProcessError, OSError):
        return False


def config_path(row: Row) -> tuple[str, ...]:
    """The config file `row` ran, relative to the repository root (none when its `config` cell is empty or
    names no config: a dash, a label with spaces)."""
    name = row.cells.get("config") or ""
    if not name or name == "-" or " " in name:
        return ()
    return (name,) if name.endswith(".json") else (f"configs/{name}.json",)


def config_section(row: Row, section: str) -> dict | None:
    """The `section` ("train", "model") of the config file `row` ran: {} for a row that names none, None
    where the file or the section cannot be read."""
    config = config_path(row)
    if not config:
        return {}
    try:
        found = json.loads((REPO / config[0]).read_text())[section]
    except (OSError, ValueError, KeyError):
        return None
    return found if isinstance(found, dict) else None


def ran_our_kernels(row: Row) -> bool:
    """Whether `row`'s run could call kernels/ (our Triton kernels): a step row (`backend` cell) whose backend
    names triton, or compile on a GPU; a training row (`overrides` cell) whose overrides or config set
    train.use_triton, or train.use_torch_compile on a GPU; any other row, by default. On one GPU
    --use-torch-compile takes the whole-step graph, whose tables (sparse kernel "torch_fused") keep the
    optimizer state that kernels/embedding_update makes. The eager and torch-graphed steps, and a run on the
    CPU without --use-triton, never import kernels/."""
    on_gpu = row.cells.get("device", "cpu") != "cpu"
    if "backend" in row.cells:
        backend = row.cells["backend"]
        return "triton" in backend or ("compile" in backend and on_gpu)
    if "overrides" not in row.cells:
        return True
    overrides = row.cells["overrides"].replace(" ", "")
    if "use_triton=true" in overrides or ("use_torch_compile=true" in overrides and on_gpu):
        return True
    train = config_section(row, "train")
    if train is None:
        return True  # a config it cannot read: count the kernels in
    return bool(train.get("use_triton", False) or (train.get("use_torch_compile", False) and on_gpu))


def interaction(row: Row) -> str | None:
    """The model.interaction `row`'s run took: its overrides' value, else its config's; None where neither
    says (a row without a config, a config it cannot read or that leaves the key to the default)."""
    found = re.search(r'model\.interaction="?([a-z_]+)', row.cells.get("overrides") or "")
    if found:
        return found.group(1)
    return (config_section(row, "model") or {}).get("interaction")


def other_interactions_kernels(row: Row) -> tuple[str, ...]:
    """The kernels of the interactions `row`'s run did not take (INTERACTION_KERNELS: all of them for "cat");
    none where its interaction is unknown."""
    taken = interaction(row)
    if taken is None:
        return ()
    return tuple(path for name, paths in INTERACTION_KERNELS.items() if name != taken for path in paths)


def one_process(row: Row) -> bool:
    """Whether `row`'s run was one process: its world_size (train.csv) or nproc (checkpoint.csv) cell is 1,
    or it has neither (quality runs, one-process benchmarks)."""
    return (row.cells.get("world_size") or row.cells.get("nproc") or "1") == "1"


def code_paths(row: Row) -> tuple[str, ...]:
    """The code `row` measured, as git pathspecs: its file's MEASURES entry (a clocks.csv row: its workload's
    CLOCKS_WORKLOADS entry); else the whole application, less
    kernels/ for a row whose run did not call them (`ran_our_kernels`) and the other interactions' kernels
    for one that did (`other_interactions_kernels`), less SEVERAL_RANKS_ONLY for a run of one process
    (`one_process`), less GPU_ONLY for a run on the CPU and less LOOP_ONLY for a step benchmark's row."""
    if row.file in MEASURES:
        return MEASURES[row.file]
    if row.file == "clocks.csv" and row.cells.get("workload") in CLOCKS_WORKLOADS:
        return CLOCKS_WORKLOADS[row.cells["workload"]]
    kernels = ran_our_kernels(row)
    paths = WHOLE if kernels else tuple(p for p in WHOLE if p != "kernels")
    skipped = other_interactions_kernels(row) if kernels else ()
    skipped += (SEVERAL_RANKS_ONLY if one_process(row) else ()) + (GPU_ONLY if on_cpu(row) else ())
    skipped += LOOP_ONLY if row.file in STEP_BENCHMARKS else ()
    return paths + tuple(f":(exclude){path}" for path in dict.fromkeys(skipped))


def on_cpu(row: Row) -> bool:
    """Whether `row`'s run was on the CPU: its device cell says "cpu" (a row without one is not counted)."""
    return row.cells.get("device", "") == "cpu"


def is_current(row: Row) -> bool:
    """Whether `row` was measured on the code (and config) that is here now."""
    paths = code_paths(row) + config_path(row)
    return commit_is_current(row.cells.get("git_sha", ""), paths)
