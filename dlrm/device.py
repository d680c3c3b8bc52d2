"""Where and how a process computes: the device (`resolve_device`), whether our Triton kernels run in
Triton's CPU interpreter (`use_interpreter_on_cpu`), and the matmul precision flags (`set_precision`).
Every command (train, evaluate, predict, export, finetune) and the process group take them from here."""

import os
import sys

import torch

from dlrm.config import RunConfig


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available else cpu. Raises ValueError for "cuda" without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' requested but no CUDA GPU is available (use auto or cpu)")
    return torch.device(name)


def use_interpreter_on_cpu(cfg: RunConfig, device: torch.device) -> None:
    """On a CPU our Triton kernels run in the interpreter, which works only when TRITON_INTERPRET=1 is set
    before triton is first imported. Raises ValueError when triton was imported without it."""
    if not (cfg.train.use_triton and device.type == "cpu") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError(
            "--use-triton on the CPU needs the Triton interpreter, but triton was imported before it could "
            "be switched on: set TRITON_INTERPRET=1 in the environment before starting Python"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def set_precision(precision: str) -> None:
    """TF32 tensor-core matmuls on for "tf32", off otherwise (process-wide torch flags; linear_act follows
    them too)."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
