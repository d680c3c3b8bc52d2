"""Benchmark the whole DLRM training step on a GPU, per config, backend and batch size.

    python scripts/bench_train.py [--configs kaggle,mlperf] [--batches 2048,16384,65536] \
        [--backends eager,compile,triton,triton+compile] [--steps 50]

Trains the real model code (dlrm.model, dlrm.step.train_step, SGD; fused into backward under triton) on
GPU-resident random batches: dense ~ U(0, 3) (the range of log1p counts), labels ~ Bernoulli(0.25), sparse
ids uniform over each table's rows (`--ids uniform`, the default: no hot rows) or drawn as
dlrm.data.synthetic draws them (`--ids zipf`: P(rank k) ~ (k + 1)^-1.15, rank 0 about 11% of a 10M-row
table's lookups, ranks scattered over the table by a multiplicative hash as the pipeline's 32-bit id hashes
and modulus scatter them), the skew of real click logs, where many lookups in a batch update the same rows;
a pool of batches is generated once and cycled, so the step never waits for data. Tables: the 26 Kaggle
cardinalities (33.8M rows; `--cardinalities terabyte`: Criteo 1TB's, 178M rows; `--cardinalities config`: the
config's own model.table_rows, e.g. dlrm_dcnv2's 204M rows of the MLPerf benchmark), capped by the config's
max_rows or `--max-rows` (e.g. 4000000 for mlperf), modulus-hashed whatever the config's `model.hashing`
(random ids have no train vocabulary to build `vocab` tables from). SGD, or `--optimizer adagrad` (its state
doubles the tables' bytes).
"compile-ro" is torch.compile's mode="reduce-overhead" (Inductor's CUDA graphs of the compiled dense part);
"compile+graphs" what `--use-torch-compile` runs on one GPU by default: the whole step one CUDA graph around
the compiled dense part, the tables plain PyTorch that update themselves in backward ("torch_fused").
"torch-graphed" is the strongest plain-PyTorch step, the baseline that the README's step ratios are stated
against (scripts/torch_graphed_step.py: one table-batched weight looked up by index_select and updated by
index_add_, the dense part torch.compile'd, the whole step one CUDA graph; SGD, "dot", modulus hashing,
Linear+ReLU MLPs, one GPU; for the "dcn" interaction scripts/torch_graphed_dcn.py: bags pooled by one
F.embedding_bag over the table-batched weight, exact Adagrad on the touched rows, Adagrad for the dense
part); the printed line gives each backend's ratio to it when it ran earlier in the
same invocation (the CSV keeps samples/s per backend, so the ratios follow from its rows).
Backends ending in "+graphs" capture the whole step as a CUDA graph (dlrm.graphs; capture time reported
apart). Every build starts from fresh dynamo state and every step runs under its precision's flags (the
caller's restored after it), so a row's flags and compiled code do not depend on what ran before it
(`build`). After warm-up (the first step, with compilation and autotuning, is timed apart) it times
`--steps` steps with CUDA events and reports ms/step, samples/s, peak GPU memory and the ratio to the eager
backend of the same invocation; each row goes to scripts/results/train.csv as soon as it is measured, so
an invocation stopped (Ctrl-C, SIGTERM, `timeout`) or killed keeps the rows before it. CUDA only: main()
refuses to start without a GPU, and everything below it (random_batches, build, bench) allocates on the
current CUDA device.

Many GPUs (weak scaling: `--batches` is the batch per GPU, the global batch is N times it):

    python scripts/bench_train.py --nproc 1,2 --configs kaggle --precisions tf32 --batches 65536 \
        --backends triton+graphs

runs the benchmark once per N, under `torchrun --standalone --nproc-per-node N` (tables sharded over the
ranks, dense gradients all-reduced in the step, as `torchrun -m dlrm.train` trains: dlrm.parallel), and
writes rows with world_size, global_batch, the per-rank spread of ms/step (the slowest rank sets the
step), samples/s of the global batch and `scaling_vs_1gpu` (samples/s over the N=1 row of the same
invocation). A Ctrl-C or SIGTERM here goes on to the run in progress, whose rows measured before it are
written with those of the runs before (`launch_each`). On several hosts run it under torchrun yourself
(`--nproc` left at 1): rank 0 appends the rows.
"""

import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from results_csv import append_rows, provenance
from torch import nn
from torch_graphed_dcn import PlainDCN, TorchGraphedDCNStep
from torch_graphed_step import PlainDLRM, TorchGraphedStep, precision_flags

from dlrm import atomic, parallel
from dlrm.choices import OPTIMIZERS, TABLE_DTYPES
from dlrm.config import load_config, replace
from dlrm.data.bags import is_one_hot
from dlrm.data.dataset import Batch
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.data.synthetic_rows import CARDINALITY_PRESETS, power_law_ranks
from dlrm.graphs import GraphedTrainStep
from dlrm.model import DLRM
from dlrm.optim import RunOptimizer
from dlrm.parallel.run import gather_values
from dlrm.parallel.sharded import build_sharded_model
from dlrm.step import compile_dense_part, train_step

RESULTS = Path(__file__).parent / "results" / "train.csv"
CONFIG_DIR = Path(__file__).parents[1] / "configs"
BASELINE = "torch-graphed"  # scripts/torch_graphed_step.py, not our model code


def graphed(backend: str) -> bool:
    """Whether `backend` replays the whole step as CUDA graphs: it is compared with the graphed baseline; a
    step launched from Python (compile-ro's graphs of the dense part included) with eager (like with like)."""
    return backend == BASELINE or backend.endswith("+graphs")


FLAGS = {
    "eager": {},
    BASELINE: {},
    "compile": {"use_torch_compile": True, "compile_mode": "default"},
    "compile-ro": {"use_torch_compile": True, "compile_mode": "reduce-overhead"},
    "compile+graphs": {"use_torch_compile": True, "cuda_graphs": True, "compile_mode": "default"},
    "triton": {"use_triton": True, "cuda_graphs": False},
    "triton+compile": {
        "use_triton": True,
        "use_torch_compile": True,
        "cuda_graphs": False,
        "compile_mode": "default",
    },
    "triton+graphs": {"use_triton": True, "cuda_graphs": True},
    "triton+compile+graphs": {
        "use_triton": True,
        "use_torch_compile": True,
        "cuda_graphs": True,
        "compile_mode": "default",
    },
    "triton_bias_act+graphs": {"use_triton": True, "triton_mlp_kernel": "bias_act", "cuda_graphs": True},
}
POOL = 8  # distinct batches cycled through
# Sharding variants on many GPUs (parallel settings): the config's (the planner's data-parallel tables, the
# lookup's dtype on the wire); every table model parallel; the exchange in bf16.
SHARDINGS = {
    "auto": {},
    "model_parallel": {"data_parallel_rows": 0},
    "bf16_exchange": {"exchange_dtype": "bf16"},
    "serial": {"overlap": False},
}
IDS = ("uniform", "zipf")
_SCATTER = 2654435761  # Knuth's multiplicative hash constant: spreads consecutive ranks over a table


def random_batches(
    batch: int, table_rows: list[int], generator: torch.Generator, ids: str, bag_sizes=None
) -> list[Batch]:
    """POOL GPU-resident batches: dense [B, 13] f32, sparse [B, 26] i64 within each table (`ids`: one of
    IDS, module docstring), label [B] f32. With `bag_sizes` (model.multi_hot_sizes, F ints k_f) sparse is
    [B, S] in dlrm.data.bags' layout, every id of feature f's bag drawn alike within table f."""
    if not is_one_hot(bag_sizes):  # one column per id, each within its feature's table
        table_rows = [rows for rows, k in zip(table_rows, bag_sizes, strict=True) for _ in range(k)]
    rows = torch.tensor(table_rows, device="cuda")
    pool = []
    for _ in range(POOL):
        dense = 3 * torch.rand(batch, NUM_DENSE, device="cuda", generator=generator)
        uniform = torch.rand(batch, len(table_rows), device="cuda", generator=generator, dtype=torch.float64)
        if ids == "zipf":
            ranks = torch.from_numpy(power_law_ranks(uniform.cpu().numpy(), table_rows)).cuda()
            sparse = ranks * _SCATTER % rows
        else:
            sparse = (uniform * rows).long()
        label = (torch.rand(batch, device="cuda", generator=generator) < 0.25).float()
        pool.append(Batch(dense, sparse, label))
    return pool


def build(
    config: str,
    backend: str,
    batch: int,
    max_rows: int | None,
    precision: str,
    ids: str,
    dist=parallel.SINGLE,
    cardinalities: str = "kaggle",
    optimizer: str = "sgd",
    sharding: str = "auto",
    table_dtype: str = "fp32",
):
    """(model, optimizer, step, pool, table_rows) for configs/<config>.json with `backend` and `optimizer`
    (train.optimizer) and tables of `table_dtype` (model.table_dtype; the torch-graphed baseline's stay
    fp32): the step is `step(model, optimizer, batch) -> loss` (graph-captured for "+graphs"
    backends), pool the batches (`ids`: one of IDS) over modulus tables of the `cardinalities` preset.
    With several ranks (`dist`) the tables are sharded (created on each rank's GPU) as the `sharding`
    variant (SHARDINGS) says, and `batch` is the batch of each rank.

    No earlier build decides this one's flags or compiled code: dynamo starts afresh (no compiled code,
    recompile counts or dynamic-shape choices of another backend, batch or precision), and every step
    runs under the flags of `precision` and gives the caller's back (`PrecisionStep`; the baseline's
    TorchGraphedStep does both itself)."""
    torch._dynamo.reset()
    flags = {"precision": precision, "optimizer": optimizer, **FLAGS[backend]}
    cfg = replace(load_config(CONFIG_DIR / f"{config}.json"), "train", **flags)
    tables = table_dtype if cfg.train.use_triton else "fp32"  # bf16 tables are the triton kernels'
    cfg = replace(cfg, "model", hashing="modulus", min_frequency=1, table_dtype=tables)
    cap = max_rows or cfg.model.max_rows
    table_rows = [min(rows, cap) for rows in preset_rows(cfg, cardinalities)]
    torch.manual_seed(0)
    kernels = {"mlp_kernel": cfg.mlp_kernel, "sparse_kernel": cfg.sparse_kernel}
    reduce_grads = None
    generator = torch.Generator(device="cuda").manual_seed(batch + 1000 * dist.rank)
    bag_sizes = cfg.model.multi_hot_sizes
    if backend == BASELINE:
        model, step = build_baseline(cfg, table_rows, dist)
        return model, None, step, random_batches(batch, table_rows, generator, ids, bag_sizes), table_rows
    if dist.enabled:
        cfg = replace(cfg, "model", table_rows=tuple(table_rows), max_rows=cap)
        cfg = replace(cfg, "data", batch_size=batch * dist.world_size)
        cfg = replace(cfg, "parallel", **SHARDINGS[sharding])
        no_ids = torch.empty(0, NUM_SPARSE, dtype=torch.int64)
        device = torch.device("cuda", torch.cuda.current_device())
        model, _ = build_sharded_model(cfg, {}, no_ids, dist.rank, dist.world_size, device)
        reduce_grads = parallel.grad_averager(parallel.averaged_parameters(model), dist.world_size)
    else:
        model = DLRM(cfg.model, table_rows=table_rows, **kernels).cuda()
    optimizer = RunOptimizer(model, cfg.train)
    if cfg.train.use_torch_compile:
        compile_dense_part(model, cfg.train.compile_mode)
    step = functools.partial(train_step, precision=precision, reduce_grads=reduce_grads)
    if cfg.train.cuda_graphs:
        step = GraphedTrainStep(model, optimizer, step)
    pool = random_batches(batch, table_rows, generator, ids, bag_sizes)
    return model, optimizer, PrecisionStep(step, precision), pool, table_rows


class PrecisionStep:
    """One of our model's steps, `step(model, optimizer, batch) -> loss`, run under the flags of
    `precision` on every call (warm-up, capture, replay), with the caller's flags back after it: the
    baseline's `precision_flags`, the flags dlrm.device.set_precision sets for a run (as
    tests/test_torch_graphed_step.py checks). `capture_s`: the wrapped step's capture time, None for a step
    it does not capture."""

    def __init__(self, step, precision: str):
        self.step, self.precision = step, precision

    @property
    def capture_s(self) -> float | None:
        return getattr(self.step, "capture_s", None)

    def __call__(self, model: nn.Module, optimizer, batch: Batch) -> torch.Tensor:
        with precision_flags(self.precision):
            return self.step(model, optimizer, batch)


class BaselineStep:
    """A TorchGraphedStep behind this script's step signature, `step(model, optimizer, batch) -> loss`."""

    def __init__(self, step: TorchGraphedStep):
        self.step = step

    @property
    def capture_s(self) -> float:
        return self.step.capture_s

    def __call__(self, model: nn.Module, optimizer: None, batch: Batch) -> torch.Tensor:
        return self.step(batch)


def preset_rows(cfg, cardinalities: str) -> tuple[int, ...]:
    """The uncapped rows of each table: the `cardinalities` preset (CARDINALITY_PRESETS), or "config": the
    config's model.table_rows. Raises click.UsageError for "config" with a config that names no table_rows."""
    if cardinalities != "config":
        return CARDINALITY_PRESETS[cardinalities]
    if not cfg.model.table_rows:
        raise click.UsageError(f"--cardinalities config: config {cfg.name!r} sets no model.table_rows")
    return cfg.model.table_rows


def build_baseline(cfg, table_rows: list[int], dist) -> tuple[nn.Module, BaselineStep]:
    """The "torch-graphed" model and step for `cfg` (its model shapes, lr and embedding_lr, precision) on
    the current GPU: scripts/torch_graphed_step.py's SGD step for the "dot" interaction, or
    scripts/torch_graphed_dcn.py's Adagrad step for "dcn" (bags or one id a table). Raises
    click.UsageError for several ranks or a config it does not cover."""
    m, t = cfg.model, cfg.train
    if dist.enabled:
        raise click.UsageError(f"backend {BASELINE} runs on one GPU: leave --nproc at 1")
    dcn = m.interaction == "dcn"
    needs = {
        "train.optimizer": (t.optimizer, "adagrad" if dcn else "sgd"),
        "train.weight_decay": (t.weight_decay, 0.0),
        "model.hashing": (m.hashing, "modulus"),
        "model.mlp_block": (m.mlp_block, "linear_act"),
        "model.lora.rank": (m.lora.rank, 0),
        "model.pooling": (m.pooling, "sum"),
    }
    if not dcn:
        needs |= {
            "model.interaction": (m.interaction, "dot"),
            "one id a table": (is_one_hot(m.multi_hot_sizes), True),
        }
    bad = [f"{key}={value!r} (needs {want!r})" for key, (value, want) in needs.items() if value != want]
    if bad:
        raise click.UsageError(f"backend {BASELINE} does not cover config {cfg.name!r}: {', '.join(bad)}")
    if dcn:
        sizes = m.multi_hot_sizes or (1,) * NUM_SPARSE
        model = PlainDCN(
            m.embedding_dim, m.bottom_mlp, m.top_mlp, table_rows, sizes, m.dcn.layers, m.dcn.low_rank
        ).cuda()
        step = TorchGraphedDCNStep(model, t.lr, t.embedding_lr, t.adagrad_eps, t.precision)
        return model, BaselineStep(step)
    model = PlainDLRM(m.embedding_dim, m.bottom_mlp, m.top_mlp, table_rows).cuda()
    return model, BaselineStep(TorchGraphedStep(model, t.lr, t.embedding_lr, t.precision))


def bench(
    config: str,
    backend: str,
    batch: int,
    steps: int,
    max_rows: int | None,
    precision: str,
    dist=parallel.SINGLE,
    ids: str = "uniform",
    cardinalities: str = "kaggle",
    optimizer: str = "sgd",
    sharding: str = "auto",
    table_dtype: str = "fp32",
) -> dict:
    """Train `steps` timed steps of configs/<config>.json with `backend` and `optimizer` at batch size
    `batch` (per rank), on random batches whose sparse ids are `ids` (one of IDS) over tables of the
    `cardinalities` preset (many ranks: sharded as `sharding` says), tables of `table_dtype`."""
    model, optimizer, step, pool, table_rows = build(
        config, backend, batch, max_rows, precision, ids, dist, cardinalities, optimizer, sharding,
        table_dtype,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step(model, optimizer, pool[0])
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    for i in range(1, 2 * POOL):  # warm-up: allocator, cuBLAS handles, remaining autotuning
        step(model, optimizer, pool[i % POOL])
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for i in range(steps):
        loss = step(model, optimizer, pool[i % POOL])
    end.record()
    torch.cuda.synchronize()
    ms = begin.elapsed_time(end) / steps
    if not torch.isfinite(loss):
        raise RuntimeError(f"{config}/{backend}/B={batch}: loss is {loss.item()}")
    peak = torch.cuda.max_memory_allocated() / 2**30
    per_rank, peaks = ([ms], [peak]) if not dist.enabled else (gather_values(ms), gather_values(peak))
    world = dist.world_size
    if dist.enabled and dist.is_main:
        print(f"peak GPU memory per rank: {', '.join(f'{p:.2f}' for p in peaks)} GiB", flush=True)
    result = {
        "config": config, "backend": backend, "batch": batch, "table_rows_total": sum(table_rows),
        "ms_per_step": round(max(per_rank), 4), "samples_per_s": round(batch * world / max(per_rank) * 1000),
        "peak_mem_gib": round(max(peaks), 2),
        "first_step_s": round(first_step_s, 2),
        "capture_s": "" if step.capture_s is None else round(step.capture_s, 2),
        "world_size": world, "global_batch": batch * world,
        "step_ms_min": round(min(per_rank), 4), "step_ms_max": round(max(per_rank), 4),
    }  # fmt: skip
    del model, optimizer, pool, step
    torch.cuda.empty_cache()
    return result


@click.command(context_settings={"show_default": True})
@click.option("--configs", default="kaggle", help="Comma-separated names of configs/*.json.")
@click.option("--batches", default="2048,16384,65536", help="Comma-separated batch sizes.")
@click.option(
    "--backends",
    default=",".join(FLAGS),
    help=f"Comma-separated; eager and {BASELINE} first for the ratios to them.",
)
@click.option("--steps", type=click.IntRange(min=1), default=50, help="Timed steps per run.")
@click.option("--max-rows", type=click.IntRange(min=2), default=None, help="Cap on rows per table.")
@click.option(
    "--precisions", default="fp32", help="Comma-separated train.precision values: fp32, tf32, bf16."
)
@click.option(
    "--ids",
    type=click.Choice(IDS),
    default="uniform",
    help="Sparse ids of the random batches: uniform over each table, or Zipf-skewed (dlrm.data.synthetic).",
)
@click.option(
    "--nproc",
    default="1",
    help="Comma-separated GPU counts N: each runs under torchrun on N GPUs of this host (weak scaling: "
    "--batches per GPU).",
)
@click.option(
    "--cardinalities",
    type=click.Choice([*CARDINALITY_PRESETS, "config"]),
    default="kaggle",
    help="Table sizes: the Criteo Kaggle or 1TB cardinalities, or the config's model.table_rows (capped by "
    "max_rows).",
)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", help="train.optimizer.")
@click.option(
    "--shardings",
    default="auto",
    help=f"Comma-separated sharding variants on many GPUs, one of {', '.join(SHARDINGS)} each: the "
    "config's parallel settings, every table model parallel, or the exchange in bf16.",
)
@click.option(
    "--table-dtype",
    type=click.Choice(list(TABLE_DTYPES)),
    default="fp32",
    help="model.table_dtype of our backends (bf16 needs a triton backend); torch-graphed keeps fp32 tables.",
)
def main(
    configs, batches, backends, steps, max_rows, precisions, ids, nproc, cardinalities, optimizer, shardings,
    table_dtype,
):  # fmt: skip
    """Time the DLRM training step per config, backend and batch; append rows to scripts/results/train.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_train.py needs a CUDA GPU")
    counts = [int(n) for n in nproc.split(",")]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout`'s SIGTERM keeps rows as Ctrl-C does
    if unknown := set(shardings.split(",")) - set(SHARDINGS):
        raise click.UsageError(f"--shardings: unknown {sorted(unknown)}; expected some of {list(SHARDINGS)}")
    if counts != [1] and "WORLD_SIZE" not in os.environ:
        rows: list[dict] = []
        try:
            launch_each(counts, rows=rows)
        finally:  # interrupted or failed: the runs' rows measured before it are whole
            append_rows(RESULTS, with_scaling(rows))
        return
    dist, _ = parallel.init_distributed("cuda", 600.0)  # one process without torchrun
    common = provenance(torch.cuda.get_device_name())
    data = "gpu-resident random ids" + (" (zipf 1.15)" if ids == "zipf" else "")
    data += {"kaggle": "", "terabyte": ", terabyte cardinalities", "config": ", the config's table rows"}[
        cardinalities
    ]
    common |= {"data": data, "optimizer": optimizer}
    rows = []  # each row kept (`_keep`) as soon as it is measured
    variants = shardings.split(",") if dist.enabled else ["auto"]  # one GPU: nothing to shard
    sizes = [int(b) for b in batches.split(",")]
    runs = itertools.product(configs.split(","), precisions.split(","), sizes, variants)
    try:
        for config, precision, batch, sharding in runs:
            eager = baseline = None
            for backend in backends.split(","):
                r = bench(
                    config, backend, batch, steps, max_rows, precision, dist, ids, cardinalities, optimizer,
                    sharding, table_dtype,
                )  # fmt: skip
                eager = r["samples_per_s"] if backend == "eager" else eager
                baseline = r["samples_per_s"] if backend == BASELINE else baseline
                # ratio_vs_eager only for launched backends: a graph replay against launches would measure
                # the launch overhead; graphed backends are compared with the graphed baseline.
                ratio = round(r["samples_per_s"] / eager, 3) if eager and not graphed(backend) else None
                vs_baseline = r["samples_per_s"] / baseline if baseline and graphed(backend) else float("nan")
                variant = "" if sharding == "auto" else f", sharding {sharding}"
                variant += ", bf16 tables" if table_dtype == "bf16" and "triton" in backend else ""
                rows.append(
                    {
                        **common,
                        "data": common["data"] + variant,
                        "precision": precision,
                        **r,
                        "ratio_vs_eager": ratio,
                    }
                )
                if dist.is_main:
                    _keep(rows)
                    print(
                        f"{config:<8}{precision:<6}{backend:<23}W={dist.world_size} B={batch:<7}"
                        f"{sharding:<15}"
                        f"{r['ms_per_step']:>9.3f} ms/step {r['samples_per_s']:>12,} samples/s  "
                        f"vs eager (launched) {ratio or float('nan'):>5.2f}x  "
                        f"vs {BASELINE} (graphed) {vs_baseline:>5.2f}x  "
                        f"peak {r['peak_mem_gib']:>6.2f} GiB (most of a rank)  "
                        f"first step {r['first_step_s']:.1f} s",
                        flush=True,
                    )
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`timeout`): the rows measured before it are kept
        if dist.is_main:
            print(f"interrupted: the {len(rows)} rows measured before it are kept", flush=True)
        raise
    parallel.shutdown()


def _keep(rows: list[dict]) -> None:
    """Rank 0's rows as each is measured, so that a run stopped or killed keeps every whole row before it:
    the newest appended to train.csv (scaling filled in), or under `launch_each` all of them written whole
    to the parent's file (`dlrm.atomic.write_text`)."""
    if os.environ.get(ROWS_ENV):  # launched by launch_each: the parent writes the CSV
        atomic.write_text(Path(os.environ[ROWS_ENV]), json.dumps(rows))
    else:
        append_rows(RESULTS, with_scaling(rows[-1:]))


ROWS_ENV = "DLRM_BENCH_ROWS"


def launcher(nproc: int) -> list[str]:
    """The command prefix that runs a Python module or script on `nproc` GPUs of this host: the interpreter
    itself for one, torchrun --standalone for more."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def launch_each(
    counts: list[int], args: list[str] | None = None, rows: list[dict] | None = None
) -> list[dict]:
    """Run this script once per GPU count (N > 1 under torchrun --standalone) with `args` (default: this
    invocation's, less --nproc); the rows of all runs, handed back through ROWS_ENV (not written), appended
    to `rows` (a new list if None) as each run ends. Ctrl-C or SIGTERM (`timeout`) here is passed on to the
    run in progress as SIGINT (torchrun passes it on to its workers, and rank 0 takes it as Ctrl-C: it hands
    back the rows measured before it), whose rows are appended before KeyboardInterrupt goes on.

    Raises:
        subprocess.CalledProcessError: a run exited non-zero (`rows` holds those of the runs before it).
    """
    if args is None:
        args = [a for a in sys.argv[1:] if not a.startswith("--nproc")]
        if "--nproc" in sys.argv[1:]:  # "--nproc N" as two arguments
            i = sys.argv[1:].index("--nproc")
            args = sys.argv[1 : i + 1] + sys.argv[i + 3 :]
    rows = [] if rows is None else rows
    for n in counts:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [*launcher(n), __file__, *args]
            child = subprocess.Popen(command, env={**os.environ, ROWS_ENV: out.name})
            try:
                code = child.wait()
            except KeyboardInterrupt:
                child.send_signal(signal.SIGINT)
                child.wait()
                rows += _handed_back(Path(out.name))
                raise
            if code:
                raise subprocess.CalledProcessError(code, command)
            rows += _handed_back(Path(out.name))
    return rows


def _handed_back(path: Path) -> list[dict]:
    """The rows a run wrote to its ROWS_ENV file; none where it wrote nothing (stopped before any)."""
    text = path.read_text()
    return json.loads(text) if text else []


def with_scaling(rows: list[dict]) -> list[dict]:
    """Rows with `scaling_vs_1gpu`: samples/s over the one-GPU row of the same config, precision, backend
    and per-GPU batch (None without one)."""
    key = ("config", "precision", "backend", "batch")
    single = {tuple(r[k] for k in key): r["samples_per_s"] for r in rows if r["world_size"] == 1}
    out = []
    for r in rows:
        base = single.get(tuple(r[k] for k in key))
        out.append({**r, "scaling_vs_1gpu": round(r["samples_per_s"] / base, 3) if base else None})
    return out


if __name__ == "__main__":
    main()
