"""Host time per call of linear_act launched from Python, and of the pieces it is made of, on a GPU.

    python scripts/bench_launch_host.py [--layer 512,256] [--batch 16384] [--precisions tf32,bf16]

Launched from Python (no CUDA graph), a small layer's forward + backward is bound by host time: what the
launch bar (<= 1.2x eager's time) measures. Each row is the wall time of 200 calls divided by 200
(the GPU idles between launches; the median of 7 rounds, after 20 warm-up calls): eager PyTorch's
Linear+ReLU, linear_act, a no-op autograd.Function (the glue every custom op pays), and each launch or
allocation linear_act's forward and backward make. Then the kaggle bottom and top MLPs whole, forward +
backward: eager PyTorch, linear_act called layer by layer, and ``kernels.linear_act.linear_act_stack`` (the
layers as one autograd node, as the model runs them), in interleaved rounds (the median of 9, 100 calls
each), each MLP's input in the model's layout (``bench_kernels.model_layout``).
Prints the table; ``--output`` also writes it.

``--cpus 0`` pins the process, and the threads it starts later (autograd's device thread, which runs every
backward), to the CPUs given: whether the hand-over between threads on different cores is part of the cost.
"""

import os
import statistics
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from bench_kernels import mlp_stacks, model_layout

from kernels.gemm.grads import act_dz, act_grads
from kernels.gemm.partials import sum_partials
from kernels.linear_act import linear_act, linear_act_fwd, linear_act_stack

DTYPES = {"tf32": torch.float32, "bf16": torch.bfloat16}


def per_call_us(fn, calls: int = 200, rounds: int = 7) -> float:
    """Median over `rounds` of the wall time of `calls` calls of fn, synchronized once per round, in us."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def probe(m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, float]:
    """{row name: us per call} for one relu layer [M, K] -> [M, N]."""
    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    gx = torch.randn_like(x)
    y = torch.relu(F.linear(x, w, b)).detach()
    dz = torch.empty_like(dy)
    part = torch.randn(128, n, device="cuda")
    xd, wd, bd = x.detach(), w.detach(), b.detach()

    def fwd_bwd(forward):
        def run():
            for t in (x, w, b):
                t.grad = None
            forward().backward(dy)

        return run

    def no_grad(forward):
        def run():
            with torch.no_grad():
                forward()

        return run

    def noop():
        x.grad = None
        _Noop.apply(x).backward(gx)

    rows = {
        "eager fwd+bwd": fwd_bwd(lambda: torch.relu(F.linear(x, w, b))),
        "linear_act fwd+bwd": fwd_bwd(lambda: linear_act(x, w, b, "relu")),
        "no-op autograd.Function fwd+bwd": noop,
        "eager fwd (no_grad)": no_grad(lambda: torch.relu(F.linear(x, w, b))),
        "linear_act fwd (no_grad)": no_grad(lambda: linear_act(x, w, b, "relu")),
        "linear_act_fwd (the launcher)": lambda: linear_act_fwd(xd, wd, bd, "relu"),
        "backward body (cuBLAS path)": lambda: act_grads(dy, xd, wd, y, "relu", True, True),
        "act_dz (dz + bias sum)": lambda: act_dz(dy, y, "relu", True, dtype),
        "sum_partials": lambda: sum_partials(part, dtype),
        "torch.mm dz @ W": lambda: torch.mm(dz, wd),
        "W.t().contiguous()": lambda: wd.t().contiguous(),
        "torch.empty [M, N]": lambda: torch.empty((m, n), dtype=dtype, device="cuda"),
    }
    return {name: per_call_us(fn) for name, fn in rows.items()}


def probe_mlp(m: int, k: int, widths: tuple[int, ...], last: str, x_grad: bool, dtype: torch.dtype):
    """{path: us per forward + backward} of one MLP on three paths, timed in interleaved rounds."""
    sizes = (k, *widths)
    weights = [
        (torch.randn(n, k_in, device="cuda", dtype=dtype) / k_in**0.5).requires_grad_()
        for k_in, n in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    biases = [torch.randn(n, device="cuda", dtype=dtype, requires_grad=True) for n in widths]
    activations = ["relu"] * (len(widths) - 1) + [last]
    x = model_layout(torch.randn(m, k, device="cuda", dtype=dtype)).requires_grad_(x_grad)
    dy = torch.randn(m, widths[-1], device="cuda", dtype=dtype)
    layers = list(zip(weights, biases, activations, strict=True))

    def run(forward):
        def step():
            for t in (x, *weights, *biases):
                t.grad = None
            forward().backward(dy)

        return step

    def eager():
        h = x
        for weight, bias, activation in layers:
            h = F.linear(h, weight, bias)
            h = torch.relu(h) if activation == "relu" else h
        return h

    def layer_by_layer():
        h = x
        for weight, bias, activation in layers:
            h = linear_act(h, weight, bias, activation)
        return h

    paths = {
        "eager": run(eager),
        "linear_act layer by layer": run(layer_by_layer),
        "linear_act_stack": run(lambda: linear_act_stack(x, weights, biases, activations)),
    }
    for step in paths.values():
        per_call_us(step, calls=20, rounds=1)
    rounds = {name: [] for name in paths}
    for _ in range(9):
        for name, step in paths.items():
            rounds[name].append(per_call_us(step, calls=100, rounds=1))
    return {name: statistics.median(times) for name, times in rounds.items()}


@click.command(context_settings={"show_default": True})
@click.option("--layer", default="512,256", help="K,N of the layer.")
@click.option("--batch", default=16384, help="Rows M (the batch B).")
@click.option("--precisions", default="tf32,bf16", help="Comma-separated: tf32, bf16.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Also write the table here.")
@click.option("--cpus", default=None, help="CPU ids to pin the process to, e.g. 0 or 0,1. [default: any]")
def main(layer, batch, precisions, output, cpus):
    """Print the host time per call of linear_act's fwd+bwd and its pieces, launched from Python."""
    if not torch.cuda.is_available():
        raise click.UsageError("needs a CUDA GPU: launch overhead is measured against the GPU driver")
    if cpus is not None:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    k, n = (int(v) for v in layer.split(","))
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.cuda.get_device_name()
    pinned = f", CPUs {sorted(os.sched_getaffinity(0))}" if cpus is not None else ""
    lines = [f"{device}, torch {torch.__version__}, M={batch}, {k} -> {n}, relu, us per call{pinned}"]
    for precision in precisions.split(","):
        for name, us in probe(batch, k, n, DTYPES[precision]).items():
            lines.append(f"{precision:5s} {name:34s} {us:8.1f}")
            click.echo(lines[-1])
        for name, k_in, widths, last in mlp_stacks("kaggle"):
            x_grad = name == "top"  # the bottom MLP's input is data
            for path, us in probe_mlp(batch, k_in, widths, last, x_grad, DTYPES[precision]).items():
                lines.append(f"{precision:5s} kaggle {name} MLP: {path:27s} {us:8.1f}")
                click.echo(lines[-1])
    if output is not None:
        output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
