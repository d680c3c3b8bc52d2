"""Where the GPU time of one training step goes: the CUDA kernels of `--steps` steps, by total time.

    python scripts/profile_step.py [--config kaggle] [--backend triton+graphs] [--batch 16384] \
        [--precision tf32] [--steps 10] [--max-rows N] [--ids uniform|zipf] [--trace-dir DIR] \
        [--cardinalities kaggle|terabyte|config] [--optimizer sgd|adagrad|rowwise_adagrad] \
        [--sharding auto|model_parallel|...] [--table-dtype fp32|bf16]

Builds the model, optimizer and GPU-resident random batches exactly as scripts/bench_train.py does, runs
the warm-up steps there (autotuning, the CUDA graph capture for "+graphs" backends), then records `--steps`
steps with torch.profiler and prints every CUDA kernel's time per step, its share of the step's kernel
time and its call count, grouped under the model stage it belongs to (by kernel name: embedding,
interaction, loss, MLP GEMMs and epilogues, optimizer, other). Kernels launched inside a CUDA graph replay
are recorded like any other. The table is also written to scripts/results/profile_<config>_<backend>_<B>.txt
(`_<precision>` appended for other precisions than tf32; with the GPU, versions and git sha); with
--trace-dir the Chrome trace goes there too (open in Perfetto).

Under torchrun (`torchrun --standalone --nproc-per-node N scripts/profile_step.py ...`, `--batch` per rank)
the tables are sharded as bench_train.py shards them and every rank writes its own table (`_rank<k>` in
the file name). NCCL's kernels get stages of their own: all_to_all (the embedding exchange: ids out,
pooled vectors back, their gradients) and all_reduce (the dense gradients, the loss). A collective's
kernel runs from the moment both ranks enter it, so its time includes waiting for the slower rank.
"""

from pathlib import Path

import click
import torch
from bench_train import FLAGS, IDS, POOL, SHARDINGS, build
from results_csv import provenance
from torch.profiler import ProfilerActivity, profile, schedule

from dlrm import parallel
from dlrm.choices import TABLE_DTYPES
from dlrm.data.synthetic_rows import CARDINALITY_PRESETS

RESULTS = Path(__file__).parent / "results"
PROFILER_WARMUP = 3  # steps the profiler runs before its window, as in bench_e2e's runs of dlrm.train
# Stage of a kernel, by a substring of its name (first match wins).
STAGES = (
    ("all_to_all", ("SendRecv", "AllToAll")),  # NCCL runs all_to_all_single as grouped send/recv
    ("all_reduce", ("AllReduce",)),
    ("embedding", ("_embedding_", "sort", "cumsum", "scan")),
    ("interaction", ("_interaction_",)),
    ("loss", ("_bce_",)),
    ("mlp", ("_linear_act_", "_bias_act_", "gemm", "sm90", "cutlass", "nvjet")),
    ("optimizer", ("foreach", "multi_tensor")),
)


def stage_of(kernel: str) -> str:
    """The model stage a kernel name belongs to, or "other"."""
    name = kernel.lower()
    return next((stage for stage, keys in STAGES if any(k.lower() in name for k in keys)), "other")


def kernel_table(prof, steps: int) -> list[tuple[str, str, float, int]]:
    """(stage, kernel name, us per step, calls per step) of every CUDA kernel, slowest first."""
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us()
        entry[1] += 1
    rows = [(stage_of(name), name, us / steps, calls // steps) for name, (us, calls) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def profile_steps(built: tuple, steps: int) -> profile:
    """The CUDA activity of `steps` steps of `built` (what bench_train.build returns), after bench_train's
    warm-up (JIT, autotuning, graph capture) and the profiler's own (its first steps record with gaps of its
    start-up, which would count as idle GPU time)."""
    model, optimizer, step, pool, _ = built
    for i in range(2 * POOL):
        step(model, optimizer, pool[i % POOL])
    torch.cuda.synchronize()
    window = schedule(wait=0, warmup=PROFILER_WARMUP, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=window) as prof:
        for i in range(PROFILER_WARMUP + steps):
            step(model, optimizer, pool[i % POOL])
            if i == PROFILER_WARMUP + steps - 1:
                torch.cuda.synchronize()  # the window's kernels end before it closes
            prof.step()
    return prof


@click.command(context_settings={"show_default": True})
@click.option("--config", default="kaggle", help="Name of a configs/*.json file.")
@click.option("--backend", type=click.Choice(list(FLAGS)), default="triton+graphs")
@click.option("--batch", type=click.IntRange(min=1), default=16384)
@click.option("--precision", type=click.Choice(["fp32", "tf32", "bf16"]), default="tf32")
@click.option("--steps", type=click.IntRange(min=1), default=10, help="Profiled steps.")
@click.option("--max-rows", type=click.IntRange(min=2), default=None, help="Cap on rows per table.")
@click.option("--ids", type=click.Choice(IDS), default="uniform", help="Sparse ids, as bench_train's --ids.")
@click.option("--trace-dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--cardinalities", type=click.Choice([*CARDINALITY_PRESETS, "config"]), default="kaggle",
    help="Table sizes, as bench_train's --cardinalities.",
)  # fmt: skip
@click.option("--optimizer", type=click.Choice(["sgd", "adagrad", "rowwise_adagrad"]), default="sgd")
@click.option("--sharding", type=click.Choice(list(SHARDINGS)), default="auto", help="Under torchrun.")
@click.option(
    "--table-dtype", type=click.Choice(list(TABLE_DTYPES)), default="fp32",
    help="model.table_dtype, as bench_train's --table-dtype (bf16 needs a triton backend).",
)  # fmt: skip
def main(
    config, backend, batch, precision, steps, max_rows, ids, trace_dir, cardinalities, optimizer, sharding,
    table_dtype,
):  # fmt: skip
    """Profile the training step on this GPU (or each rank's, under torchrun) and print its kernels by
    time."""
    if not torch.cuda.is_available():
        raise click.UsageError("profile_step.py needs a CUDA GPU")
    dist, _ = parallel.init_distributed("cuda", 600.0)  # one process without torchrun
    built = build(config, backend, batch, max_rows, precision, ids, dist, cardinalities, optimizer, sharding,
                  table_dtype)  # fmt: skip
    prof = profile_steps(built, steps)
    rows = kernel_table(prof, steps)
    total = sum(r[2] for r in rows)
    info = provenance(torch.cuda.get_device_name())
    lines = [
        f"# python scripts/profile_step.py --config {config} --backend {backend} --batch {batch} "
        f"--precision {precision} --ids {ids} --cardinalities {cardinalities} --optimizer {optimizer} "
        f"--sharding {sharding} --table-dtype {table_dtype}: "
        f"rank {dist.rank} of {dist.world_size}, {info['device']}, torch {info['torch']}, "
        f"triton {info['triton']}, git {info['git_sha']}",
        f"# kernel time per step {total:.1f} us "
        f"({batch / total * 1e6:,.0f} samples/s if the kernels ran back to back)",
    ]
    for stage in [s for s, _ in STAGES] + ["other"]:
        us = sum(r[2] for r in rows if r[0] == stage)
        lines.append(f"{stage:<12}{us:>10.1f} us/step  {100 * us / total:>5.1f}%")
    lines.append(f"{'stage':<12}{'us/step':>10}  {'share':>6}  {'calls':>5}  kernel")
    lines += [
        f"{s:<12}{us:>10.1f}  {100 * us / total:>5.1f}%  {n:>5}  {name[:100]}" for s, name, us, n in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = ("_zipf" if ids == "zipf" else "") + ("" if cardinalities == "kaggle" else f"_{cardinalities}")
    suffix += f"_{optimizer}" if optimizer != "sgd" else ""
    suffix += f"_{precision}" if precision != "tf32" else ""
    suffix += f"_{table_dtype}tables" if table_dtype != "fp32" else ""
    suffix += f"_{sharding}" if dist.enabled and sharding != "auto" else ""
    suffix += f"_rank{dist.rank}of{dist.world_size}" if dist.enabled else ""
    out = RESULTS / f"profile_{config}_{backend.replace('+', '_')}_{batch}{suffix}.txt"
    out.write_text(text)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"{out.stem}.json"))
    parallel.shutdown()


if __name__ == "__main__":
    main()
