"""Where a training step's time goes, part by part, each part beside its own bound.

    python scripts/breakdown_step.py --config dlrm_dcnv2 --cardinalities terabyte --max-rows 4000000 \
        --batch 65536 --precision bf16 --optimizer adagrad [--table-dtype bf16]

Builds the step as scripts/bench_train.py does (its model, optimizer and GPU-resident random batches, bags
at the config's `model.multi_hot_sizes`), then:
1. times the whole step as bench_train times it with `--graph-backend` (default "triton+graphs": one CUDA
   graph a step), the number a user's step runs at;
2. profiles `--steps` steps of the same model launched from Python (`--backend`, default "triton": a graph
   replay hides which operation launched a kernel) and gives each CUDA kernel to the part of the step that
   launched it: forward kernels by the model's `record_function` ranges (embedding, bottom_mlp, each
   `cross_layer_<l>` of the DCNv2 interaction, or `cross_net`, our backends' one op for all of them,
   interaction, top_mlp, loss, optimizer), backward kernels by
   the autograd node that launched them, traced back to the forward range that made the node (the
   profiler's sequence numbers link the two);
3. puts each part beside its bound, the larger of FLOPs / the measured GEMM peak of the step's precision
   and bytes / the measured copy bandwidth (scripts/bench_timing.measure_ceilings), with the byte and FLOP
   counts below.

Counts (glossary letters; a = bytes of an activation: 2 under bf16, else 4; w = bytes of a table element,
`--table-dtype`: 4 for fp32, 2 for bf16):
    embedding fwd     bytes B*S*8 (ids) + B*S*D*w (rows gathered) + B*F*D*a (pooled out)
    embedding bwd     bytes B*S*D*a (each lookup's bag gradient row: the update sums a row's gradient over
                      its lookups, sorted by row, so a bag's row is read once for each of its S/F lookups
                      a feature, out of L2's reach at these sizes) + B*S*8 (ids) + U*(2*D*w + 2*state)
                      (each touched row's weights and optimizer state read and written once; U = distinct
                      rows of the batch, counted on the profiled batches; state = D*4 for adagrad, 4 for
                      rowwise_adagrad)
    MLP layer K->N    fwd FLOPs 2*B*K*N, bytes B*(K+N)*a + K*N*a; bwd twice the FLOPs (dX and dW),
                      bytes 2*B*(K+N)*a + 2*K*N*4
    cross layer       fwd FLOPs 4*B*N*r (V then U), bytes 3*B*N*a (x0, x_l read, x_l+1 written) + 2*N*r*a;
                      bwd FLOPs 8*B*N*r, bytes 6*B*N*a + 4*N*r*4
    cross_net         L cross layers, and in the backward (L-1)*B*N*a more (x0's running gradient read)
    dot interaction   fwd FLOPs 2*B*(F+1)^2*D, bytes B*(F+1)*D*a + B*out*a; bwd twice
    loss              bytes 3*B*4 each way
    optimizer         bytes P*4*5 for adagrad (weights, gradient, state read; weights, state written),
                      P*4*3 for sgd
A part's measured time is its kernels' GPU time per step; parts on the side stream (the embedding) overlap
others, so the parts can add up to more than the step. Under the table, the slowest parts' kernels, each
with its launches a step and the operation that launched it (an aten op, or the range or Python op that
called a Triton kernel), until they make up KERNEL_SHARE of the part's time. The table goes to
scripts/results/breakdown_<config>_<precision>_<B>[_zipf][_bf16tables].txt and one row per part to
scripts/results/breakdown.csv.
Needs a CUDA GPU, one process.
"""

import math
from pathlib import Path

import click
import torch
from bench_timing import measure_ceilings
from bench_train import BASELINE, FLAGS, IDS, POOL, bench, build
from results_csv import append_rows, provenance
from torch.profiler import ProfilerActivity, profile, schedule

from dlrm.choices import TABLE_DTYPES
from dlrm.config import load_config
from dlrm.data.bags import bag_starts, is_one_hot
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.data.synthetic_rows import CARDINALITY_PRESETS

RESULTS = Path(__file__).parent / "results"
CONFIG_DIR = Path(__file__).parents[1] / "configs"
FORWARD_PARTS = ("embedding", "bottom_mlp", "interaction", "top_mlp", "first_order", "loss")
BACKWARD_NODE = "autograd::engine::evaluate_function"
TOP_PARTS = 5  # the slowest parts' kernels listed under the table: those that make up KERNEL_SHARE of the
KERNEL_SHARE, MOST_KERNELS = 0.95, 16  # part's time, at most MOST_KERNELS, the rest summed on one line
# The backends whose steps launch their kernels from Python: a profile of a CUDA graph's replay
# (torch-graphed, *+graphs, reduce-overhead's) names no op that launched a kernel, so every part reads 0.
LAUNCHED = [name for name, flags in FLAGS.items() if name != BASELINE and not flags.get("cuda_graphs")
            and flags.get("compile_mode") != "reduce-overhead"]  # fmt: skip
RUNTIME_PREFIXES = ("cuda", "cuLaunch")  # the runtime and driver calls a profile shows launching a kernel
# (part, launching op, kernel name) -> [us, launches] a step
Kernels = dict[tuple[str, str, str], list[float]]


def ancestors(event) -> list:
    """`event` and its CPU parents, innermost first."""
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain


def forward_part(chain: list) -> str | None:
    """The innermost part range (the cross network or a cross layer before the interaction around it) of a
    forward event."""
    for e in chain:
        if e.name.startswith("cross_layer_") or e.name in FORWARD_PARTS or e.name == "cross_net":
            return e.name
        if e.name == "optimizer":
            return "optimizer"
    return None


def node_parts(events) -> dict[int, str]:
    """{sequence number: part} of the autograd nodes that `events` (CPU events of launched steps) made, by
    the forward part of the event that made each. Every op the autograd dispatch key sees records the
    number the next node will take, whether it makes one or not: an op made under no_grad before the
    forward (the optimizer's, a step's first ops) carries the number of the forward's first node. The op
    that makes the node takes that number last (the next op reads the next number), so in time order the
    latest forward event with a number names its node's part."""
    node_part: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.sequence_nr < 0:
            continue
        chain = ancestors(e)
        if not any(a.name.startswith(BACKWARD_NODE) for a in chain):
            part = forward_part(chain)
            if part is not None:
                node_part[e.sequence_nr] = part
    return node_part


def launching_op(chain: list) -> str:
    """The operation that launched a kernel: the innermost event of `chain` (the event holding the kernel
    and its ancestors, innermost first) that is not a CUDA runtime or driver call (a Triton kernel is
    launched by cuLaunchKernel under the range or op that called it)."""
    return next((e.name for e in chain if not e.name.startswith(RUNTIME_PREFIXES)), chain[0].name)


def kernel_parts(prof, steps: int) -> tuple[dict[str, float], Kernels, float]:
    """({part: kernel us per step}, {(part, launching op, kernel name): [us, launches] per step}, all CUDA
    kernels' us per step) of a profile of launched steps."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    node_part = node_parts(events)
    parts: dict[str, float] = {}
    kernels: Kernels = {}
    for e in events:
        if not e.kernels:
            continue
        chain = ancestors(e)
        node = next((a for a in chain if a.name.startswith(BACKWARD_NODE)), None)
        if node is not None:
            owner = node_part.get(node.sequence_nr)
            if owner is not None:
                part = f"{owner} bwd"
            elif "AccumulateGrad" in node.name:
                part = "grad accumulate"
            else:
                part = f"bwd {node.name.removeprefix(BACKWARD_NODE + ': ')}"
        else:
            owner = forward_part(chain)
            part = "other" if owner is None else owner if owner == "optimizer" else f"{owner} fwd"
        parts[part] = parts.get(part, 0.0) + sum(k.duration for k in e.kernels) / steps
        op = launching_op(chain)
        for k in e.kernels:
            entry = kernels.setdefault((part, op, k.name), [0.0, 0.0])
            entry[0] += k.duration / steps
            entry[1] += 1 / steps
    total = sum(
        e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return parts, kernels, total / steps


def mlp_counts(widths: list[int], batch: int, a: int) -> tuple[float, float, float, float]:
    """(fwd FLOPs, fwd bytes, bwd FLOPs, bwd bytes) of an MLP through `widths` (module docstring)."""
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    flops = sum(2 * batch * k * n for k, n in pairs)
    fwd_bytes = sum(batch * (k + n) * a + k * n * a for k, n in pairs)
    bwd_bytes = sum(2 * batch * (k + n) * a + 2 * k * n * 4 for k, n in pairs)
    return flops, fwd_bytes, 2 * flops, bwd_bytes


def distinct_rows(pool, table_rows: list[int], bag_sizes) -> float:
    """Mean over `pool`'s batches of the distinct table rows their ids touch (modulus hashing)."""
    sizes = [1] * NUM_SPARSE if is_one_hot(bag_sizes) else list(bag_sizes)
    counts = []
    for batch in pool:
        touched = 0
        for f, (start, k) in enumerate(zip(bag_starts(sizes), sizes, strict=True)):
            touched += torch.unique((batch.sparse[:, start : start + k] + 1) % table_rows[f]).numel()
        counts.append(touched)
    return sum(counts) / len(counts)


def part_counts(
    cfg,
    batch: int,
    precision: str,
    optimizer: str,
    distinct: float,
    dense_params: int,
    cross_net: bool,
    table_bytes: int = 4,
) -> dict:
    """{part: (FLOPs, bytes)} of one step of `cfg`'s model at `batch` (module docstring's counts); the DCNv2
    layers as one part "cross_net" where `cross_net` (our backend's one op), else a part a layer."""
    m = cfg.model
    a = 2 if precision == "bf16" else 4
    d, f = m.embedding_dim, NUM_SPARSE
    s = f if is_one_hot(m.multi_hot_sizes) else sum(m.multi_hot_sizes)
    state = {"adagrad": d * 4, "rowwise_adagrad": 4}.get(optimizer, 0)
    counts = {
        "embedding fwd": (0.0, batch * s * 8 + batch * s * d * table_bytes + batch * f * d * a),
        "embedding bwd": (
            0.0,
            batch * s * d * a + batch * s * 8 + distinct * (2 * d * table_bytes + 2 * state),
        ),
        "loss fwd": (0.0, 3 * batch * 4),
        "loss bwd": (0.0, 3 * batch * 4),
        "optimizer": (0.0, dense_params * 4 * (5 if optimizer != "sgd" else 3)),
    }
    fl, fb, bl, bb = mlp_counts([NUM_DENSE, *m.bottom_mlp], batch, a)
    counts |= {"bottom_mlp fwd": (fl, fb), "bottom_mlp bwd": (bl, bb)}
    n = (f + 1) * d
    if m.interaction == "dcn":
        r = m.dcn.low_rank
        layers = m.dcn.layers
        fwd = (4 * batch * n * r, 3 * batch * n * a + 2 * n * r * a)
        bwd = (8 * batch * n * r, 6 * batch * n * a + 4 * n * r * 4)
        if cross_net:
            counts["cross_net fwd"] = (layers * fwd[0], layers * fwd[1])
            counts["cross_net bwd"] = (layers * bwd[0], layers * bwd[1] + (layers - 1) * batch * n * a)
        else:
            for layer in range(layers):
                counts[f"cross_layer_{layer} fwd"], counts[f"cross_layer_{layer} bwd"] = fwd, bwd
        top_in = n
    else:
        top_in = d + f * (f + 1) // 2 if m.interaction == "dot" else n
        flops = 2 * batch * (f + 1) ** 2 * d
        io = batch * (f + 1) * d * a + batch * top_in * a
        counts |= {"interaction fwd": (flops, io), "interaction bwd": (2 * flops, 2 * io)}
    fl, fb, bl, bb = mlp_counts([top_in, *m.top_mlp], batch, a)
    counts |= {"top_mlp fwd": (fl, fb), "top_mlp bwd": (bl, bb)}
    return counts


def part_kernels(kernels: Kernels, part: str) -> tuple[list[tuple[float, float, str, str]], int, float]:
    """(listed, rest, rest_us) of `part`: its kernels (us, launches, op, name) a step, slowest first, until
    they make up KERNEL_SHARE of the part's time or MOST_KERNELS are listed; how many are left and their
    us."""
    mine = sorted(
        ((us, calls, op, name) for (p, op, name), (us, calls) in kernels.items() if p == part), reverse=True
    )
    total, listed, covered = sum(k[0] for k in mine), [], 0.0
    for kernel in mine:
        if covered >= KERNEL_SHARE * total or len(listed) == MOST_KERNELS:
            break
        listed.append(kernel)
        covered += kernel[0]
    rest = mine[len(listed) :]
    return listed, len(rest), sum(k[0] for k in rest)


def profile_parts(built, steps: int) -> tuple[dict[str, float], Kernels, float]:
    """kernel_parts of `steps` launched steps of `built` (bench_train.build), after its warm-up."""
    model, optimizer, step, pool, _ = built
    for i in range(2 * POOL):
        step(model, optimizer, pool[i % POOL])
    torch.cuda.synchronize()
    window = schedule(wait=0, warmup=2, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=window) as prof:
        for i in range(2 + steps):
            step(model, optimizer, pool[i % POOL])
            if i == 1 + steps:
                torch.cuda.synchronize()
            prof.step()
    return kernel_parts(prof, steps)


@click.command(context_settings={"show_default": True})
@click.option("--config", default="dlrm_dcnv2", help="Name of a configs/*.json file.")
@click.option(
    "--backend", type=click.Choice(LAUNCHED), default="triton",
    help="Profiled, launched (a graph's replay hides which op launched a kernel).",
)  # fmt: skip
@click.option("--graph-backend", type=click.Choice(list(FLAGS)), default="triton+graphs", help="Timed.")
@click.option("--batch", type=click.IntRange(min=1), default=65536)
@click.option("--precision", type=click.Choice(["fp32", "tf32", "bf16"]), default="bf16")
@click.option("--optimizer", type=click.Choice(["sgd", "adagrad"]), default="adagrad")
@click.option("--steps", type=click.IntRange(min=1), default=5, help="Profiled steps.")
@click.option("--max-rows", type=click.IntRange(min=2), default=4_000_000, help="Cap on rows per table.")
@click.option("--ids", type=click.Choice(IDS), default="uniform", help="Sparse ids, as bench_train's --ids.")
@click.option("--cardinalities", type=click.Choice(list(CARDINALITY_PRESETS)), default="terabyte")
@click.option(
    "--table-dtype", type=click.Choice(list(TABLE_DTYPES)), default="fp32",
    help="model.table_dtype of the step (bf16 needs a triton backend), as bench_train's --table-dtype.",
)  # fmt: skip
def main(
    config, backend, graph_backend, batch, precision, optimizer, steps, max_rows, ids, cardinalities,
    table_dtype,
):  # fmt: skip
    """Break one training step down part by part, each part beside its bound; rows to breakdown.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("breakdown_step.py needs a CUDA GPU")
    ceilings = measure_ceilings()
    peak = ceilings["gemm_tflops_bf16" if precision == "bf16" else "gemm_tflops_tf32"]
    step = bench(config, graph_backend, batch, 50, max_rows, precision, ids=ids, cardinalities=cardinalities,
                 optimizer=optimizer, table_dtype=table_dtype)  # fmt: skip
    built = build(config, backend, batch, max_rows, precision, ids, cardinalities=cardinalities,
                  optimizer=optimizer, table_dtype=table_dtype)  # fmt: skip
    model, _, _, pool, table_rows = built
    cfg = load_config(CONFIG_DIR / f"{config}.json")
    distinct = distinct_rows(pool, table_rows, cfg.model.multi_hot_sizes)
    dense_params = sum(p.numel() for p in model.dense_parameters())
    parts, kernels, kernel_us = profile_parts(built, steps)
    table_bytes = next(model.sparse_arch.parameters()).element_size()  # the built tables' element
    counts = part_counts(
        cfg, batch, precision, optimizer, distinct, dense_params, "triton" in backend, table_bytes
    )
    info = provenance(torch.cuda.get_device_name())
    lines = [
        f"# python scripts/breakdown_step.py --config {config} --batch {batch} --precision {precision} "
        f"--optimizer {optimizer} --max-rows {max_rows} --ids {ids} --cardinalities {cardinalities} "
        f"--table-dtype {table_dtype}: "
        f"{info['device']}, torch {info['torch']}, triton {info['triton']}, git {info['git_sha']}",
        f"# ceilings: copy {ceilings['copy_gbps']:,.0f} GB/s, GEMM {peak:,.0f} TFLOP/s ({precision}); "
        f"distinct rows a batch {distinct:,.0f}",
        f"# {graph_backend} step {step['ms_per_step']:.3f} ms ({step['samples_per_s']:,} samples/s); "
        f"{backend} launched: kernels {kernel_us / 1000:.3f} ms a step",
        f"{'part':<24}{'us/step':>10}{'bound us':>10}{'of bound':>9}{'GFLOP':>9}{'MB':>9}  bound by",
    ]
    rows = []
    for part in sorted(set(parts) | set(counts), key=lambda p: -parts.get(p, 0.0)):
        us = parts.get(part, 0.0)
        flops, nbytes = counts.get(part, (math.nan, math.nan))
        flop_us, byte_us = flops / peak / 1e6, nbytes / ceilings["copy_gbps"] / 1e3
        bound = max(flop_us, byte_us) if part in counts else math.nan
        limit = "" if part not in counts else "FLOPs" if flop_us > byte_us else "bytes"
        share = bound / us if us else math.nan
        gflop, mbytes = flops / 1e9, nbytes / 1e6
        lines.append(f"{part:<24}{us:>10.1f}{bound:>10.1f}{share:>9.0%}{gflop:>9.1f}{mbytes:>9.1f}  {limit}")
        rows.append({
            "config": config, "precision": precision, "optimizer": optimizer, "table_dtype": table_dtype,
            "batch": batch,
            "max_rows": max_rows, "ids": ids, "part": part, "us_per_step": round(us, 1),
            "bound_us": "" if math.isnan(bound) else round(bound, 1), "bound_by": limit,
            "gflop": "" if math.isnan(flops) else round(flops / 1e9, 2),
            "mbytes": "" if math.isnan(nbytes) else round(nbytes / 1e6, 2),
            "step_ms": step["ms_per_step"], "step_backend": graph_backend,
            "copy_gbps": round(ceilings["copy_gbps"]), "gemm_tflops": round(peak),
        })  # fmt: skip
    lines.append(
        f"# the kernels of the {TOP_PARTS} slowest parts (those that make up {KERNEL_SHARE:.0%} of a part's "
        f"time, at most {MOST_KERNELS}): us/step, launches/step, the op that launched it, the kernel"
    )
    for part in sorted(parts, key=lambda p: -parts[p])[:TOP_PARTS]:
        listed, rest, rest_us = part_kernels(kernels, part)
        lines += [
            f"{part:<24}{us:>10.1f}{calls:>6.0f}  {op[:40]:<40}  {name[:80]}"
            for us, calls, op, name in listed
        ]
        if rest:
            lines.append(f"{part:<24}{rest_us:>10.1f}{'':>6}  ({rest} more kernels)")
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = ("_zipf" if ids == "zipf" else "") + ("_bf16tables" if table_dtype == "bf16" else "")
    (RESULTS / f"breakdown_{config}_{precision}_{batch}{suffix}.txt").write_text(text)
    append_rows(RESULTS / "breakdown.csv", [dict(info, **r) for r in rows])


if __name__ == "__main__":
    main()
