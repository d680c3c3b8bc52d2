"""The training step and what it is built from: device, precision, optimizer, compiled dense part, and the
step itself (`train_step`), plain or captured as a whole-step CUDA graph (`build_step`).

    model = build_model(...).to(device)
    optimizer = make_optimizer(model, cfg)
    step = build_step(model, optimizer, cfg, device)     # train_step, or its CUDA-graph replay
    loss = step(model, optimizer, batch)                 # 0-d device tensor, no host sync
"""

import functools
import os
import sys
from collections.abc import Callable

import torch
from torch.profiler import record_function

from dlrm.config import RunConfig
from dlrm.data.dataset import Batch
from dlrm.graphs import GraphedTrainStep
from dlrm.model import DLRM

StepFn = Callable[[DLRM, torch.optim.Optimizer, Batch], torch.Tensor]


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


def make_optimizer(model: DLRM, cfg: RunConfig) -> torch.optim.Optimizer:
    """SGD or Adagrad with two parameter groups: the MLPs (weight decay) and the embedding tables (sparse
    gradients, `embedding_lr`, no weight decay: decaying every row each step would make the update dense).
    With the "triton" sparse kernel the tables are not in the torch optimizer: the same update (lr
    `embedding_lr`, Adagrad's default eps) is fused into the embedding kernel's backward."""
    t = cfg.train
    embedding_lr = t.embedding_lr or t.lr
    groups = [{"params": model.dense_parameters(), "lr": t.lr, "weight_decay": t.weight_decay}]
    if model.sparse_arch.kernel == "triton":
        model.sparse_arch.configure_optimizer(t.optimizer, embedding_lr)
    else:
        groups.append({"params": model.embedding_parameters(), "lr": embedding_lr, "weight_decay": 0.0})
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr)
    return torch.optim.Adagrad(groups, lr=t.lr)


def compile_dense_part(model: DLRM, mode: str = "default") -> None:
    """Compile the MLPs and the interaction with Inductor, in place, in torch.compile's `mode` ("default"
    or "reduce-overhead": CUDA graphs of the compiled part, one per batch size). The embedding lookups
    stay eager: their sparse gradients do not compile. The batch dimension is dynamic from the start, so
    the last partial batch and the eval batch size do not trigger recompiles."""
    for module in (model.dense_arch, model.interaction_arch, model.over_arch):
        module.compile(dynamic=True, mode=mode)


def train_step(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    precision: str = "fp32",
    reduce_grads: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimization step on `batch`; returns the mean BCE-with-logits loss, a device scalar (no sync).
    With precision "bf16" the forward runs under bf16 autocast (the loss is computed in fp32).
    `reduce_grads` (many ranks: dlrm.parallel.dense.grad_averager) runs between backward and the
    optimizer: the dense gradients' all-reduce, inside the step (and inside its CUDA graph)."""
    # A new iteration for Inductor's CUDA graphs (compile_mode "reduce-overhead"), whose outputs of the
    # last step may be overwritten from here on; without them this is a no-op.
    torch.compiler.cudagraph_mark_step_begin()
    with (
        record_function("forward"),
        torch.autocast(batch.dense.device.type, torch.bfloat16, precision == "bf16"),
    ):
        logits = model(batch.dense, batch.sparse)
    with record_function("loss"):
        loss = model.loss(logits, batch.label)
    with record_function("backward"):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if reduce_grads is not None:
        with record_function("allreduce"):
            reduce_grads()
    with record_function("optimizer"):
        optimizer.step()
    return loss


def build_step(
    model: DLRM,
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    device: torch.device,
    reduce_grads: Callable[[], None] | None = None,
) -> StepFn:
    """The run's training step: `train_step` at the config's precision (with `reduce_grads`, see
    train_step), on a dense part compiled when `train.use_torch_compile`, replayed as one CUDA graph when
    `train.cuda_graphs`.

    Raises:
        ValueError: `train.cuda_graphs` on a device other than CUDA.
    """
    t = cfg.train
    if t.use_torch_compile:
        compile_dense_part(model, t.compile_mode)
    step: StepFn = functools.partial(train_step, precision=t.precision, reduce_grads=reduce_grads)
    if t.cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graphs needs a CUDA device, the run is on {device}")
        step = GraphedTrainStep(model, optimizer, step)
    return step
