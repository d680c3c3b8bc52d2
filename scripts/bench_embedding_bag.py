"""Benchmark the pooled bag lookup and its fused optimizer update (kernels.embedding_bag) on a GPU.

    python scripts/bench_embedding_bag.py [--batch 65536] [--dim 128] [--sizes mlperf] [--max-rows 40000000]
        [--optimizers rowwise_adagrad,sgd,adagrad] [--weights bf16|fp32]

Tables: the Criteo 1TB cardinalities + 1 capped at --max-rows, one table-batched weight; bags of --sizes
(MLPerf DLRM-DCNv2's by default, S = 214 ids a sample): uniform one-hot ids made into pareto bags as
dlrm.data.bags makes them (heavy repeats of the first rows). For each optimizer:
    fwd    ours: one launch hashes, gathers and pools [B, F, D]
           torch: the same pooled lookup as one F.embedding_bag over the table-batched weight (the bags
           of a sample are contiguous in the [B, S] layout: offsets b * S + start_f)
    step   fwd + the update from a given pooled gradient [B, F, D], every touched row once (EXACT):
           ours: the fused backward (kernels.embedding_bag); bf16 weights rounded stochastically, as a
           run's bf16 tables are, or to nearest (`--rounding`; the plain-PyTorch step rounds to nearest)
           torch: the strongest capturable plain-PyTorch form, the torch-graphed DCNv2 baseline's
           (scripts/torch_graphed_dcn.py): per-lookup gradients by index_select, torch.sort of the B*S
           rows numbering the distinct rows, their sums by index_add_ into one slot each, each slot's row
           gathered, stepped and scattered back by index_select / index_copy_, all fixed shapes
Both are timed as CUDA-graph replays (triton.testing.do_bench medians) and, for ours, also as launched
from Python. Each row's % of the copy bandwidth is its bytes model over its time (`step_bytes`): the
forward reads 8 B of ids and writes 8 B of index per lookup, reads a row of the weights' dtype per lookup
and writes [B, F, D]; the step adds the update: the index sorted (~3 x 8 B per lookup), the pooled
gradient read once per lookup (a row of D in the weights' dtype: the pooled output has the tables' dtype,
and so has the gradient a model's backward hands the update), and per distinct row touched the weights and
the optimizer state read and written once (SGD on fp32 weights adds atomically, no sort: a row read and
written per lookup).
Rows are appended to scripts/results/embedding_bag.csv; our step's CUDA kernels, each with its us and
launches a step and its share of the step's kernel time (a profile of PROFILED_STEPS steps launched
from Python), to scripts/results/embedding_bag_kernels.csv. Needs a CUDA GPU. Memory at the defaults: bf16
weights of ~163M rows x 128 (42 GB), plus per step the [B*S, D] buffers of the plain-PyTorch step (~4 of
~7 GB each); "adagrad" adds an fp32 [R, D] state (83 GB): lower --max-rows (e.g. 4000000, the MLPerf step
config's cap) where that does not fit.
"""

from pathlib import Path

import click
import torch
import torch.nn.functional as F
from bench_timing import graph_ms, measure_ceilings, median_ms
from profile_step import kernel_table
from results_csv import append_rows, provenance
from torch.profiler import ProfilerActivity, profile
from torch_graphed_dcn import segments

from dlrm.data.bags import BagMaker, parse_sizes
from dlrm.data.schema import NUM_SPARSE
from dlrm.data.synthetic_rows import TERABYTE_CARDINALITIES
from kernels.embedding_bag import embedding_bag_lookup
from kernels.embedding_bag_update import bag_columns
from kernels.embedding_update import optimizer_state

RESULTS = Path(__file__).parent / "results" / "embedding_bag.csv"
KERNELS = Path(__file__).parent / "results" / "embedding_bag_kernels.csv"
PROFILED_STEPS = 5
# A kernel's name in the kernels file, cut to this many characters (C++ template names run to thousands).
KERNEL_NAME = 120
ROTATE = 4
LR, EPS = 0.01, 1e-8


def capped_rows(max_rows: int) -> list[int]:
    """Each table's rows: the Criteo 1TB cardinality + 1 (the modulus tables' size), capped at max_rows."""
    return [min(k + 1, max_rows) for k in TERABYTE_CARDINALITIES]


def _torch_lookup(weights, offsets_in_table, rows, bag_offsets, features, ids, pooling):
    """Plain PyTorch pooled lookup: (out [B, F, D], index [B, S])."""
    index = torch.remainder(ids + 1, rows[features]) + offsets_in_table[features]
    out = F.embedding_bag(index.reshape(-1), weights, bag_offsets, mode=pooling)
    return out.view(ids.shape[0], NUM_SPARSE, -1), index


def _torch_update(weights, state, index, grad, features, scales, optimizer):
    """Plain PyTorch EXACT update with fixed shapes (capturable), as torch_graphed_dcn's: each lookup's
    gradient summed into its segment's slot (index_add_), each slot's row gathered, stepped and scattered
    back (index_select / index_copy_); slots past the last segment hold the spare last row of `weights`
    [R + 1, D] (and `state`), which changes nothing."""
    d = weights.shape[1]
    lookup_segment, slot_rows = segments(index.reshape(-1), weights.shape[0] - 1)
    per_lookup = (grad.float().index_select(1, features) * scales[:, None]).reshape(-1, d)
    sums = torch.zeros_like(per_lookup).index_add_(0, lookup_segment, per_lookup)
    w = weights.index_select(0, slot_rows).float()
    if optimizer == "sgd":
        w.sub_(LR * sums)
    else:
        s = state.index_select(0, slot_rows)
        s += sums * sums if optimizer == "adagrad" else (sums * sums).mean(1)
        state.index_copy_(0, slot_rows, s)
        w.sub_(LR * sums / ((s.sqrt() if optimizer == "adagrad" else s.sqrt()[:, None]) + EPS))
    weights.index_copy_(0, slot_rows, w.to(weights.dtype))


def step_bytes(
    op: str, lookups: int, distinct: int, bags: int, d: int, weight_bytes: int, optimizer: str
) -> int:
    """The bytes a row's op moves at least (module docstring): "fwd" the pooled lookup of `lookups` ids
    into `bags` [B * F] pooled rows of D; "step" that plus the update of the `distinct` rows they touch."""
    width = weight_bytes * d
    fwd = lookups * (16 + width) + bags * width
    if op == "fwd":
        return fwd
    if optimizer == "sgd" and weight_bytes == 4:  # atomic adds: a row read and written per lookup
        return fwd + lookups * 3 * width
    state = {"sgd": 0, "adagrad": 4 * d, "rowwise_adagrad": 4}[optimizer]
    return fwd + lookups * (24 + width) + distinct * 2 * (width + state)


def kernel_times(step, steps: int = PROFILED_STEPS) -> list[tuple[str, str, float, int]]:
    """profile_step's ``kernel_table`` (stage, kernel, us a step, launches a step; slowest first) of `step`
    launched `steps` times from Python under the profiler, after one call outside it."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_table(prof, steps)


def bench(
    b: int, d: int, sizes, max_rows: int, optimizer: str, dtype, copy_gbps: float, rounding: str
) -> tuple[list[dict], list[dict]]:
    """(the rows of one optimizer, our step's kernels: ``kernel_times``)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    table_rows = capped_rows(max_rows)
    rows = torch.tensor(table_rows, device="cuda")
    offsets = torch.cumsum(rows, 0) - rows
    bag_sizes = torch.tensor(sizes, device="cuda")
    s = sum(sizes)
    maker = BagMaker(sizes, table_rows, "pareto", 0)
    ids = [maker(torch.randint(0, 2**32, (b, NUM_SPARSE), device="cuda", generator=g)) for _ in range(ROTATE)]
    # The pooled gradient in the pooled output's dtype (the weights'), as a model's backward gives it.
    grads = [torch.randn(b, NUM_SPARSE, d, device="cuda", generator=g).to(dtype) for _ in range(ROTATE)]
    # One row more than the tables: the plain-PyTorch update's spare row (ours never reads it).
    weights = torch.empty(sum(table_rows) + 1, d, device="cuda", dtype=dtype).uniform_(-0.01, 0.01)
    state = optimizer_state(weights, optimizer)
    lr = torch.full((), LR, device="cuda")
    # bf16 weights round stochastically by default, as a run's bf16 tables do (RunOptimizer.table_rounding).
    bf16 = dtype == torch.bfloat16
    seed_count = torch.tensor([1, 0], device="cuda") if bf16 and rounding == "stochastic" else None
    features, scales = bag_columns(bag_sizes, "sum", s)
    starts = torch.cumsum(bag_sizes, 0) - bag_sizes
    bag_offsets = (torch.arange(b, device="cuda")[:, None] * s + starts).reshape(-1)
    it = iter(range(10**9))

    def ours_fwd():
        with torch.no_grad():
            embedding_bag_lookup(weights, state, offsets, rows, bag_sizes, ids[next(it) % ROTATE])

    leaf = weights.requires_grad_(True)

    def ours_step():
        i = next(it) % ROTATE
        out = embedding_bag_lookup(
            leaf,
            state,
            offsets,
            rows,
            bag_sizes,
            ids[i],
            "modulus",
            "sum",
            optimizer,
            lr,
            EPS,
            rounding=seed_count,
        )
        out.backward(grads[i])

    def torch_fwd():
        with torch.no_grad():
            _torch_lookup(weights, offsets, rows, bag_offsets, features, ids[next(it) % ROTATE], "sum")

    def torch_step():
        i = next(it) % ROTATE
        with torch.no_grad():
            _, index = _torch_lookup(weights, offsets, rows, bag_offsets, features, ids[i], "sum")
            _torch_update(weights, state, index, grads[i], features, scales, optimizer)

    times = {
        ("fwd", "ours", "launch"): median_ms(ours_fwd),
        ("fwd", "ours", "graph"): graph_ms(ours_fwd),
        ("fwd", "torch", "graph"): graph_ms(torch_fwd),
        ("step", "ours", "launch"): median_ms(ours_step),
        ("step", "ours", "graph"): graph_ms(ours_step),
        ("step", "torch", "graph"): graph_ms(torch_step),
    }
    kernels = kernel_times(ours_step)
    lookups = b * s
    with torch.no_grad():
        _, index = _torch_lookup(weights, offsets, rows, bag_offsets, features, ids[0], "sum")
    distinct = int(torch.unique(index).numel())

    def moved(op: str) -> int:
        return step_bytes(op, lookups, distinct, b * NUM_SPARSE, d, weights.element_size(), optimizer)

    out = []
    for (op, path, timing), ms in times.items():
        base = times.get((op, "torch", "graph")) if timing == "graph" else None
        out.append({
            "op": op, "path": path, "timing": timing, "optimizer": optimizer, "dim": d, "lookups": lookups,
            "weights": str(dtype).removeprefix("torch."),
            "rounding": "" if op == "fwd" or not bf16 else rounding if path == "ours" else "nearest",
            "ms": round(ms, 4),
            "ratio_vs_torch_graph": round(base / ms, 2) if base else "",
            "pct_copy_bw": round(100 * moved(op) / ms / 1e6 / copy_gbps, 1) if path == "ours" else "",
        })  # fmt: skip
    return out, kernels


def needed_gib(b: int, d: int, s: int, max_rows: int, optimizer: str, element_size: int) -> float:
    """GiB of GPU memory that one optimizer's runs hold at least: the weights (one spare row), the optimizer
    state (fp32: [R, D] for adagrad, [R] for rowwise_adagrad) and the plain-PyTorch step's four [B*S, D]
    fp32 buffers (module docstring)."""
    rows = sum(capped_rows(max_rows))
    state = {"adagrad": rows * d * 4, "rowwise_adagrad": rows * 4}.get(optimizer, 0)
    return ((rows + 1) * d * element_size + state + 4 * b * s * d * 4) / 2**30


def check_memory(b: int, d: int, s: int, max_rows: int, optimizers: list[str], element_size: int) -> None:
    """Refuse, before any run, an optimizer whose runs cannot fit in the GPU's total memory.

    Raises:
        click.UsageError: naming the optimizer, the GiB it needs and the GiB the GPU has, and what to lower.
    """
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    for optimizer in optimizers:
        need = needed_gib(b, d, s, max_rows, optimizer, element_size)
        if need > total:
            raise click.UsageError(
                f"--optimizers {optimizer} at --max-rows {max_rows:,}, --batch {b:,}, --dim {d} needs at "
                f"least {need:.0f} GiB of GPU memory, the GPU has {total:.0f} GiB: lower --max-rows (e.g. "
                "4000000) or --batch, or leave that optimizer out"
            )


@click.command(context_settings={"show_default": True})
@click.option("--batch", default=65536, help="Batch size B.")
@click.option("--dim", default=128, help="Embedding dim D.")
@click.option("--sizes", default="mlperf", help="Bag sizes: 'mlperf' or 26 comma-separated ints.")
@click.option("--max-rows", default=40_000_000, help="Rows cap per table.")
@click.option(
    "--optimizers",
    default="rowwise_adagrad,sgd",
    help="Fused optimizers to time (adagrad: + R x D fp32 state).",
)
@click.option("--weights", "weights_dtype", type=click.Choice(["bf16", "fp32"]), default="bf16")
@click.option(
    "--rounding", type=click.Choice(["stochastic", "nearest"]), default="stochastic",
    help="How our update rounds bf16 weights (the plain-PyTorch step rounds to nearest).",
)  # fmt: skip
def main(batch, dim, sizes, max_rows, optimizers, weights_dtype, rounding):
    """Time the bag kernel against capturable plain PyTorch; rows go to scripts/results/embedding_bag.csv, our
    step's kernels to scripts/results/embedding_bag_kernels.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_embedding_bag.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    dtype = torch.bfloat16 if weights_dtype == "bf16" else torch.float32
    sizes = parse_sizes(sizes)
    check_memory(batch, dim, sum(sizes), max_rows, optimizers.split(","), dtype.itemsize)
    copy_gbps = measure_ceilings()["copy_gbps"]
    print(f"{gpu}: copy {copy_gbps:.0f} GB/s, B={batch}, D={dim}, S={sum(sizes)}, rows cap {max_rows:,}")
    rows, kernel_rows = [], []
    for optimizer in optimizers.split(","):
        measured, kernels = bench(batch, dim, sizes, max_rows, optimizer, dtype, copy_gbps, rounding)
        rows += measured
        step_us = sum(us for _, _, us, _ in kernels)
        print(f"{optimizer}: our step's kernels, {step_us / 1e3:.3f} ms of GPU time a step")
        for _, kernel, us, launches in kernels:
            print(f"  {us:9.1f} us  {launches:3d} launches  {kernel[:100]}")
            kernel_rows.append({
                "optimizer": optimizer, "weights": str(dtype).removeprefix("torch."),
                "rounding": rounding if dtype == torch.bfloat16 else "",
                "kernel": kernel[:KERNEL_NAME], "us": round(us, 1), "launches": launches,
                "pct_of_step": round(100 * us / step_us, 1),
            })  # fmt: skip
        torch.cuda.empty_cache()
    common = provenance(gpu)
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items() if v != ""))
    append_rows(RESULTS, [dict(common, batch=batch, max_rows=max_rows, **r) for r in rows])
    append_rows(KERNELS, [dict(common, batch=batch, max_rows=max_rows, **r) for r in kernel_rows])


if __name__ == "__main__":
    main()
