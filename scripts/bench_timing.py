"""Timing helpers of the kernel benchmarks (bench_kernels, bench_cross, bench_sparse, bench_embedding_bag):
medians of CUDA-event timings launched from Python and of CUDA-graph replays, and this GPU's ceilings."""

from datetime import datetime

import torch
from torch_graphed_step import precision_flags
from triton.testing import do_bench

DTYPES = {"tf32": torch.float32, "bf16": torch.bfloat16}
ROTATE = 4  # input sets cycled through between repeats
PASSES = ("launch fwd", "launch fwd+bwd", "graph fwd", "graph fwd+bwd")


def median_ms(fn) -> float:
    """Median ms of `fn()` (triton.testing.do_bench: warm-up 50 ms, 200 ms of repeats)."""
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and GEMM TFLOP/s per precision (tf32: TF32 tensor-core matmuls
    on), measured on this GPU."""
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ceilings = {"copy_gbps": 2 * src.numel() * 4 / median_ms(lambda: dst.copy_(src)) / 1e6}
    n = 8192
    for name, dtype in DTYPES.items():
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        with precision_flags(name):  # the tf32 ceiling on the tensor cores, whatever the caller's flags
            ceilings[f"gemm_tflops_{name}"] = 2 * n**3 / median_ms(lambda a=a, b=b: a @ b) / 1e9
    return ceilings


def captured(step, repeats: int):
    """The replay of one CUDA graph of `repeats` calls of `step()`, warmed up outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotuning, allocations) outside the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            step()
    return graph.replay


def graph_ms(step, repeats: int = 20) -> float:
    """GPU time of one `step()`: `repeats` calls captured in a CUDA graph, median of replays / repeats.
    No host launch overhead: this is what the kernels cost when the training step is graph-captured."""
    return median_ms(captured(step, repeats)) / repeats


def rotating_passes(fn, sets: list[tuple]):
    """(fwd, fwd_bwd): two callables that run `fn` on the next of the input `sets` (inputs..., dy), forward
    without autograd, or forward and backward of dy into fresh gradients of every input."""
    i = iter(range(10**9))

    def fwd():
        *inputs, _ = sets[next(i) % len(sets)]
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        *inputs, dy = sets[next(i) % len(sets)]
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(dy)

    return fwd, fwd_bwd


def time_passes(fn, sets: list[tuple], compiled: bool) -> dict[str, float]:
    """Median ms of `fn(*inputs)` on rotating input `sets` (inputs..., dy): forward and forward+backward,
    launched from Python and as CUDA-graph replays; compile seconds (the first call) when `compiled`."""
    compile_s = 0.0
    if compiled:
        torch.cuda.synchronize()
        start = datetime.now()
        *inputs, dy = sets[0]
        fn(*inputs).backward(dy)
        with torch.no_grad():
            fn(*inputs)
        torch.cuda.synchronize()
        compile_s = (datetime.now() - start).total_seconds()
    fwd, fwd_bwd = rotating_passes(fn, sets)
    return {
        "launch fwd": median_ms(fwd),
        "launch fwd+bwd": median_ms(fwd_bwd),
        "graph fwd": graph_ms(fwd),
        "graph fwd+bwd": graph_ms(fwd_bwd),
        "compile_s": compile_s,
    }
