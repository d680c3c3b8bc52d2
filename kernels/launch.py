"""How our Triton kernels run in this process: compiled for a CUDA GPU, or in Triton's CPU interpreter."""

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
