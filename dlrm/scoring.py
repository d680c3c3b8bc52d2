"""The model that `dlrm.evaluate` and `dlrm.predict` score with: by default the run's own kernels and
precision, so that evaluating a run's best.pt reproduces the test numbers the run reported.

A run evaluates with the model it trains: our Triton kernels under `--use-triton`, bf16 autocast under
`train.precision` "bf16", TF32 matmuls under "tf32". Scoring the same weights with plain PyTorch kernels in
fp32 gives other logits (bf16 rounds every activation), so "run" is the default and "eager" / "fp32" are
choices. A `--use-torch-compile` run scores with the eager kernels: Inductor computes the same functions,
its results differing from eager's by fp32 rounding only.
"""

from dataclasses import dataclass

import torch

from dlrm.choices import SCORING_BACKENDS as BACKENDS
from dlrm.choices import SCORING_PRECISIONS as PRECISIONS
from dlrm.cli_options import choice_option
from dlrm.config import RunConfig, replace
from dlrm.device import set_precision, use_interpreter_on_cpu
from dlrm.model import Model, model_from_checkpoint

backend_option = choice_option(
    "--backend",
    choices=BACKENDS,
    default="run",
    help="Kernels to score with: run (the run's own: our Triton kernels for a --use-triton run), eager "
    "(plain PyTorch), triton (our Triton kernels; the interpreter on a CPU).",
)
precision_option = choice_option(
    "--precision",
    choices=PRECISIONS,
    default="run",
    help="Arithmetic to score in: run (the run's train.precision), fp32, tf32 or bf16 (autocast).",
)


def scoring_options(command):
    """`--backend` and `--precision` (click options) for a command that scores a checkpoint."""
    return backend_option(precision_option(command))


@dataclass(frozen=True)
class Scoring:
    """How a checkpoint is scored: the model's `mlp_kernel` and `sparse_kernel` (dlrm.model) and the
    `precision` ("fp32", "tf32" or "bf16") of its forward (dlrm.metrics.forward_logits)."""

    mlp_kernel: str
    sparse_kernel: str
    precision: str


def resolve_scoring(cfg: RunConfig, backend: str, precision: str) -> Scoring:
    """The kernels and precision of `backend` and `precision` (BACKENDS, PRECISIONS) for the run of `cfg`.

    Raises:
        ValueError: an unknown backend or precision.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if backend == "eager":
        kernels = ("torch", "torch")
    elif backend == "triton" and not cfg.train.use_triton:
        kernels = (cfg.train.triton_mlp_kernel, "triton")
    else:
        kernels = (cfg.mlp_kernel, cfg.sparse_kernel)
    return Scoring(*kernels, cfg.train.precision if precision == "run" else precision)


def scoring_model(
    cfg: RunConfig, table_rows: list[int], weights: dict, scoring: Scoring, device: torch.device
) -> Model:
    """The eval-mode model of a checkpoint's config, table sizes and weights with `scoring`'s kernels, on
    `device`; sets the process's TF32 flags for its precision, and on a CPU switches our Triton kernels to
    the interpreter.

    Raises:
        ValueError: the weights do not fit the config; Triton kernels on a CPU after triton was imported
            without the interpreter (set TRITON_INTERPRET=1).
    """
    if scoring.sparse_kernel == "triton":
        use_interpreter_on_cpu(replace(cfg, "train", use_triton=True), device)
    set_precision(scoring.precision)
    model = model_from_checkpoint(cfg.model, table_rows, weights, scoring.mlp_kernel, scoring.sparse_kernel)
    return model.to(device).eval()
