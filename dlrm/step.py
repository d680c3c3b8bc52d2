"""The training step and what it is built from: compiled dense part, non-finite guard, and the step itself
(`train_step`), plain or captured as a whole-step CUDA graph (`build_step`).

    model = build_model(...).to(device)
    optimizer = RunOptimizer(model, cfg.train)            # dlrm.optim: dense, tables and learning rates
    step = build_step(model, optimizer, cfg, device)     # train_step, or its CUDA-graph replay
    loss = step(model, optimizer, batch)                 # 0-d device tensor, no host sync

With `train.on_nonfinite` "skip_batch" the step carries a `NonFiniteGuard`: a step whose loss is NaN or
infinite leaves weights and optimizer state as they were, decided on the device (no host sync, so it is
captured in the CUDA graph too).
"""

import functools
from collections.abc import Callable

import torch
from loguru import logger
from torch.profiler import record_function

from dlrm.config import RunConfig, replace
from dlrm.data.dataset import Batch
from dlrm.graphs import GraphedTrainStep
from dlrm.model import DLRM, Model
from dlrm.optim import RunOptimizer

StepFn = Callable[[Model, RunOptimizer, Batch], torch.Tensor]


def resolve_cuda_graphs(cfg: RunConfig, device: torch.device, ranks: int = 1) -> RunConfig:
    """`cfg` with `train.cuda_graphs` decided: null (the default) becomes true where the whole-step graph
    works, else false: `use_triton` on a CUDA device (one rank or many: there the exchanges and the dense
    all-reduce are captured in the graph too), and `use_torch_compile` alone on one CUDA device (its tables
    then update themselves in backward in plain PyTorch, sparse kernel "torch_fused", which do not shard).
    One log line says why when such a run goes without it (launched from Python, our custom ops cost more
    host time than they save; kernel "torch"'s sparse update syncs the host every step). "Works" is what
    dlrm.config accepts for `cuda_graphs` true (its rules, one place) on `ranks` ranks. True or false stay
    as given (true is validated by dlrm.config).

    Raises:
        ValueError: `cuda_graphs` true under `use_torch_compile` alone on more than one rank.
    """
    t = cfg.train
    compiled_alone = t.use_torch_compile and not t.use_triton
    if t.cuda_graphs is not None:
        if t.cuda_graphs and compiled_alone and ranks > 1:
            raise ValueError(
                f"train.cuda_graphs: expected false or null with --use-torch-compile on {ranks} ranks (its "
                "whole-step graph runs on one; --use-triton graphs many)"
            )
        return cfg
    if device.type != "cuda" or not (t.use_triton or t.use_torch_compile):
        return replace(cfg, "train", cuda_graphs=False)
    flag = "--use-triton" if t.use_triton else "--use-torch-compile"
    if compiled_alone and ranks > 1:
        logger.info("{} without the whole-step CUDA graph: it runs on one rank, not {}", flag, ranks)
        return replace(cfg, "train", cuda_graphs=False)
    try:
        return replace(cfg, "train", cuda_graphs=True)
    except ValueError as why:  # the config's reason, naming the key
        logger.info("{} without the whole-step CUDA graph: {}", flag, why)
        return replace(cfg, "train", cuda_graphs=False)


# The largest batch at which Inductor's CUDA graphs ("reduce-overhead") measured faster than its default
# mode for --use-torch-compile (H200, scripts/bench_train.py backends compile and compile-ro in one run,
# scripts/results/train.csv: kaggle tf32 at 128, 2,048 and 16,384 rows 12-41% faster, at 65,536 even;
# mlperf bf16 at 65,536 4% slower). Below it the compiled step is launch-bound, above its kernels' time.
REDUCE_OVERHEAD_MAX_BATCH = 16_384


def resolve_compile_mode(cfg: RunConfig, device: torch.device) -> RunConfig:
    """`cfg` with `train.compile_mode` "auto" decided (`auto_compile_mode`); one log line names the mode and
    why when the run compiles. Other modes stay as given."""
    if cfg.train.compile_mode != "auto":
        return cfg
    mode, why = auto_compile_mode(cfg, device)
    if cfg.train.use_torch_compile:
        logger.info("torch.compile mode {} (train.compile_mode auto): {}", mode, why)
    return replace(cfg, "train", compile_mode=mode)


def auto_compile_mode(cfg: RunConfig, device: torch.device) -> tuple[str, str]:
    """(mode, why) of `train.compile_mode` "auto" (after `resolve_cuda_graphs`): "reduce-overhead" for
    `use_torch_compile` on a CUDA device at a batch of at most REDUCE_OVERHEAD_MAX_BATCH rows, where it
    measured faster; "default" with the whole-step graph (it captures the compiled part itself, and
    Inductor's graphs cannot be recorded inside it), with `use_triton` (measured only without), on the
    CPU and at larger batches."""
    t, batch = cfg.train, cfg.data.batch_size
    if t.cuda_graphs:
        return "default", "the whole-step CUDA graph captures the compiled part"
    if t.use_triton:
        return "default", "Inductor's CUDA graphs are measured without --use-triton only"
    if device.type != "cuda":
        return "default", f"no CUDA graphs on {device.type}"
    if batch > REDUCE_OVERHEAD_MAX_BATCH:
        return "default", f"at batch {batch:,} (> {REDUCE_OVERHEAD_MAX_BATCH:,}) its graphs save no time"
    return "reduce-overhead", f"Inductor's CUDA graphs: at batch {batch:,} the step is launch-bound"


def inductor_cuda_graphs(cfg: RunConfig, device: torch.device) -> bool:
    """Whether Inductor records CUDA graphs of its own in the run (`use_torch_compile` in compile mode
    "reduce-overhead", given or decided by "auto")."""
    t = cfg.train
    mode = auto_compile_mode(cfg, device)[0] if t.compile_mode == "auto" else t.compile_mode
    return t.use_torch_compile and mode == "reduce-overhead"


def compile_dense_part(model: Model, mode: str = "default") -> None:
    """Compile the model's dense modules (the MLPs, the interaction, the first-order dense layer) with
    Inductor, in place, in torch.compile's `mode` ("default" or "reduce-overhead": CUDA graphs of the
    compiled part, one per batch size). The embedding lookups (first-order ones too) stay eager: their
    sparse gradients do not compile. The batch dimension is dynamic from the start, so
    the last partial batch and the eval batch size do not trigger recompiles."""
    if isinstance(model, DLRM) and model.interaction_arch.interaction == "attention":
        # Inductor's coalescing analysis fails an assertion on the attention backward's dynamic-shape
        # kernels in bf16 (InductorError in tiling_utils.get_pw_red_splits, torch 2.11 on an H100); without
        # the analysis Inductor keeps its default tiling. A global flag: read when a graph is compiled.
        torch._inductor.config.triton.coalesce_tiling_analysis = False
    for module in model.dense_modules():
        module.compile(dynamic=True, mode=mode)


class _GradGate(torch.autograd.Function):
    """Identity forward; backward passes the gradient where `ok` (a 0-d bool device tensor, set after the
    forward) holds, zeros otherwise: torch.where, so NaN gradients become exact zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        ctx.ok = ok  # not save_for_backward: the guard writes `ok` in place after this forward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.where(ctx.ok, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None


class NonFiniteGuard:
    """Skips the update of a step whose loss is not finite (`train.on_nonfinite` "skip_batch"), on the device.

    - Embedding tables: the gradient flowing into the embeddings is gated (a forward hook on each SparseArch,
      the first-order tables' too, puts `_GradGate` after the lookup), so the "triton" kernel's fused SGD /
      Adagrad update in backward and the eager tables' sparse update both add exact zeros: the rows and
      Adagrad accumulators keep their values.
    - MLPs: their gradients are zeroed by torch.where before `optimizer.step()`; SGD and Adagrad then leave
      the weights as they were. With weight decay the decay term would still move them, so the weights and
      optimizer state of the dense parameters are also restored by torch.where after the step.

    `ok` is the last step's verdict, a 0-d bool device tensor.
    """

    def __init__(self, model: Model, optimizer: RunOptimizer, device: torch.device):
        self.model, self.optimizer = model, optimizer
        self.ok = torch.ones((), dtype=torch.bool, device=device)
        self.restore = any(group.get("weight_decay", 0.0) for group in optimizer.param_groups)
        for tables in model.table_archs():
            tables.register_forward_hook(self._gate)

    def _gate(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return _GradGate.apply(output, self.ok) if torch.is_grad_enabled() else output

    def check(self, loss: torch.Tensor) -> None:
        """Set `ok` from the step's loss, before backward."""
        self.ok.copy_(torch.isfinite(loss.detach()))

    def step(self) -> None:
        """`optimizer.step()`, a no-op for the weights when the loss was not finite."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        zero = torch.zeros((), device=self.ok.device)
        for p in params:
            if not p.grad.is_sparse:  # sparse gradients (eager tables) are already gated, exactly zero
                p.grad.copy_(torch.where(self.ok, p.grad, zero.to(p.grad.dtype)))
        if not self.restore:
            self.optimizer.step()
            return
        dense = [p for p in params if not p.grad.is_sparse]
        kept = [[t, t.detach().clone()] for p in dense for t in self._tensors(p)]
        self.optimizer.step()
        with torch.no_grad():
            for t, old in kept:
                t.copy_(torch.where(self.ok, t, old))

    def _tensors(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.optimizer.state.get(p, {})
        return [p, *(v for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point())]


def train_step(
    model: Model,
    optimizer: RunOptimizer,
    batch: Batch,
    precision: str = "fp32",
    guard: NonFiniteGuard | None = None,
    reduce_grads: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimization step on `batch`; returns the mean BCE-with-logits loss, a device scalar (no sync).
    With precision "bf16" the forward runs under bf16 autocast (the loss is computed in fp32). With a
    `guard`, a non-finite loss leaves the weights unchanged (see NonFiniteGuard). `reduce_grads` (many
    ranks: dlrm.parallel.dense.grad_averager) runs between backward and the optimizer: the dense
    gradients' all-reduce, inside the step (and inside its CUDA graph)."""
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
        if guard is not None:
            guard.check(loss)
    with record_function("backward"):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if reduce_grads is not None:
        with record_function("allreduce"):
            reduce_grads()
    with record_function("optimizer"):
        if guard is None:
            optimizer.step()
        else:
            guard.step()
    return loss


def build_step(
    model: Model,
    optimizer: RunOptimizer,
    cfg: RunConfig,
    device: torch.device,
    reduce_grads: Callable[[], None] | None = None,
) -> StepFn:
    """The run's training step: `train_step` at the config's precision (with `reduce_grads`, see
    train_step), on a dense part compiled when `train.use_torch_compile` (compile mode "auto" decided
    here, `resolve_compile_mode`; `train.cuda_graphs` already decided), replayed as one CUDA graph when
    `train.cuda_graphs`, guarded against non-finite losses when `train.on_nonfinite` is "skip_batch".

    Raises:
        ValueError: `train.cuda_graphs` on a device other than CUDA.
    """
    t = cfg.train
    if t.use_torch_compile:
        compile_dense_part(model, resolve_compile_mode(cfg, device).train.compile_mode)
    guard = NonFiniteGuard(model, optimizer, device) if t.on_nonfinite == "skip_batch" else None
    step: StepFn = functools.partial(
        train_step, precision=t.precision, guard=guard, reduce_grads=reduce_grads
    )
    if t.cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"train.cuda_graphs needs a CUDA device, the run is on {device}")
        step = GraphedTrainStep(model, optimizer, step)
    return step
