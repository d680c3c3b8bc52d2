"""How our Triton kernels run in this process: compiled for a CUDA GPU, or in Triton's CPU interpreter."""

import functools
import os

import torch
from torch import Tensor

# Triton reads TRITON_INTERPRET when triton is imported and kernels are decorated, so a later change of the
# variable does not change how the kernels run.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # accepted input dtypes


def use_triton(x: Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only in the interpreter (TRITON_INTERPRET=1);
    elsewhere the ops fall back to their PyTorch reference."""
    return x.device.type == "cuda" or (x.device.type == "cpu" and INTERPRETED)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty`` for a buffer a launcher hands to a kernel to fill. Launchers call it as
    ``launch.empty`` so that the tests, poisoning it with NaN in this one place, check that the kernels
    write every element."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.cache
def own_stream(device: int, use: str) -> torch.cuda.Stream:
    """A CUDA stream of PyTorch's high-priority pool for one `use` on `device` (an index), drawn once, so
    each use keeps one stream that no other code of ours draws: dlrm.graphs captures its graphs on streams
    of the default-priority pool, and destroying a CUDA graph drops the cuBLAS workspace cached for the
    stream it was captured on, which a live graph captured on that stream still uses
    (pytorch/pytorch#193402). The uses: a backward's weight gradients beside its input gradients
    (kernels.gemm.grads.dw_stream) and graph_time's timing graphs (kernels.gemm.tuning), two streams."""
    return torch.cuda.Stream(device, priority=-1)


def capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream):
    """torch.cuda.graph(graph) on `stream`, in the thread-local capture mode: unsafe CUDA calls of this
    thread still fail the capture; another thread's (a loader's, a checkpoint writer's device-to-host
    copies) do not."""
    return torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")
