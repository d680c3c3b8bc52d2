"""Benchmark the DCNv2 cross layer on a GPU, x_{l+1} = x0 * (U (V x_l) + b) + x_l: one layer, or `--layers`
L of them as the model runs them; eager, torch.compile and ours (kernels.cross, kernels.cross_net).

    python scripts/bench_cross.py [--batches 16384,65536] [--precisions tf32,bf16] [--width 3456] [--rank 512]
        [--layers 1]

Paths, on the same inputs (x0, x_l [B, N], V [r, N], U [N, r], b [N]; the defaults are MLPerf DLRM-DCNv2's
N = 27 x 128, r = 512):
    eager     x0 * F.linear(F.linear(xl, V), U, b) + xl        PyTorch ops, the baseline
    compile   torch.compile of that function                    Inductor (compile time reported apart)
    triton    kernels.cross.cross_layer                         our GEMM with the elementwise tail in its
                                                                epilogue, forward and backward
With L > 1 the inputs are x0 [B, N] and the layers' V, U, b stacked ([L, r, N], [L, N, r], [L, N]): eager
and compile run the layer above L times (x0's gradient summed by autograd), triton runs
kernels.cross_net.cross_net (x0's gradient summed inside the backward kernels), the model's "triton" path.
Each path timed forward and forward + backward (gradients of every input), launched from Python and as
CUDA-graph replays (bench_timing's `time_passes`: median of CUDA-event timings, inputs rotated over
several sets). TFLOP/s count the layers' GEMM work, 4 B N r L forward and 12 B N r L forward + backward (two
GEMMs forward, four backward), against the measured GEMM rate. Rows go to scripts/results/cross.csv; ratios
are eager / path and compile / path in the same run.
"""

from pathlib import Path

import click
import torch
import torch.nn.functional as F
from bench_timing import DTYPES, PASSES, ROTATE, measure_ceilings, time_passes
from results_csv import append_rows, provenance

from kernels.cross import cross_layer
from kernels.cross_net import cross_net

RESULTS = Path(__file__).parent / "results" / "cross.csv"
PATHS = ("eager", "compile", "triton")


def eager_layer(x0, xl, v, u, b):
    return x0 * F.linear(F.linear(xl, v), u, b) + xl


def eager_net(x0, v, u, b):
    x = x0
    for layer in range(v.shape[0]):
        x = eager_layer(x0, x, v[layer], u[layer], b[layer])
    return x


def layer_sets(m: int, n: int, r: int, layers: int, dtype: torch.dtype) -> list[tuple]:
    """ROTATE input sets (inputs..., dy) of one cross layer (`layers` 1: x0, x_l, V, U, b) or of the network
    of `layers` (x0 and the layers' V, U, b stacked), every input requiring its gradient."""
    g = torch.Generator(device="cuda").manual_seed(m + n + r)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", dtype=dtype, generator=g) * scale).requires_grad_()

    sets = []
    for _ in range(ROTATE):
        x0 = randn(m, n)
        if layers == 1:
            inputs = (x0, randn(m, n), randn(r, n, scale=n**-0.5), randn(n, r, scale=r**-0.5), randn(n))
        else:
            inputs = (
                x0,
                randn(layers, r, n, scale=n**-0.5),
                randn(layers, n, r, scale=r**-0.5),
                randn(layers, n),
            )
        sets.append((*inputs, torch.randn(m, n, device="cuda", dtype=dtype, generator=g)))
    return sets


def layer_fn(path: str, layers: int):
    """The function of `path` (one of PATHS) over layer_sets' inputs; compile's with fresh dynamo state."""
    eager, ours = (eager_layer, cross_layer) if layers == 1 else (eager_net, cross_net)
    if path == "triton":
        return ours
    if path == "compile":
        torch._dynamo.reset()
        return torch.compile(eager, dynamic=False)
    return eager


def bench_cross(path: str, m: int, n: int, r: int, layers: int, dtype: torch.dtype) -> dict[str, float]:
    """Median ms of one cross layer (`layers` 1) or of the network of `layers` on one path, per pass of
    PASSES, and compile seconds."""
    sets = layer_sets(m, n, r, layers, dtype)
    return time_passes(layer_fn(path, layers), sets, path == "compile")


@click.command()
@click.option("--batches", default="16384,65536", show_default=True, help="batch sizes B, comma-separated")
@click.option("--precisions", default="tf32,bf16", show_default=True, help="tf32 and/or bf16")
@click.option("--width", default=3456, show_default=True, help="N, the cross network's width")
@click.option("--rank", default=512, show_default=True, help="r, the low rank")
@click.option(
    "--layers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="L: 1 times one layer, more the network of L layers (the model's layers: dcn.layers)",
)
@click.option("--paths", default=",".join(PATHS), show_default=True, help="paths to time, eager first")
def main(batches, precisions, width, rank, layers, paths):
    """Time the cross layer (or network) per path on this GPU; rows appended to scripts/results/cross.csv."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench_cross.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    gpu = torch.cuda.get_device_name()
    ceilings = measure_ceilings()
    common = provenance(gpu)
    path_list = paths.split(",")
    n, r = width, rank
    what = "layer" if layers == 1 else f"network of {layers} layers"
    print(f"{gpu}: cross {what} N={n} r={r}, ms (x eager, x compile)")
    for precision in precisions.split(","):
        peak = ceilings[f"gemm_tflops_{precision}"]
        for m in (int(v) for v in batches.split(",")):
            times = {p: bench_cross(p, m, n, r, layers, DTYPES[precision]) for p in path_list}
            rows = []
            for ps in PASSES:
                flops = (12 if ps.endswith("bwd") else 4) * m * n * r * layers
                cells = []
                for p in path_list:
                    ms = times[p][ps]
                    vs_eager = times[path_list[0]][ps] / ms
                    vs_compile = times["compile"][ps] / ms if "compile" in times else float("nan")
                    cells.append(f"{p} {ms:.4f} ({vs_eager:.2f}x, {vs_compile:.2f}x)")
                    tflops = flops / ms / 1e9
                    rows.append(dict(
                        common, width=n, rank=r, layers=layers, batch=m, precision=precision, path=p,
                        **{"pass": ps},
                        ms=round(ms, 5), tflops=round(tflops, 2), pct_gemm_peak=round(100 * tflops / peak, 2),
                        ratio_vs_eager=round(vs_eager, 3), ratio_vs_compile=round(vs_compile, 3),
                        compile_s=round(times[p]["compile_s"], 2),
                    ))  # fmt: skip
                print(f"{precision:<5}{m:>7}  {ps:<15}" + "   ".join(cells))
            append_rows(RESULTS, rows)


if __name__ == "__main__":
    main()
