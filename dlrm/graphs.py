"""Whole-step CUDA graph capture of the training step (`train.cuda_graphs`, `--cuda-graphs`), and of the
evaluation forward (`GraphedForward`).

Without graphs a DLRM step costs milliseconds of host time at every batch size: each of its ~100 kernel
launches goes through Python, autograd and the dispatcher. Captured once into a CUDA graph, forward,
loss, backward, the fused embedding update and the optimizer step replay as one launch; the host only
copies the next batch into the graph's static input buffers.

What can be captured: every op of the step must run without a host sync and with fixed shapes. That holds
for the `--use-triton` model (the table-batched embedding applies its optimizer update inside backward,
with no data-dependent shapes) and dlrm.optim's SGD and Adagrad for the dense parameters (foreach ops, the
lr scale a device tensor); it does not hold for the eager embeddings (sparse gradients are coalesced with a
host sync): the config requires `use_triton`, or `use_torch_compile` on one device, whose tables then update
themselves in backward in plain PyTorch (sparse kernel "torch_fused").

Every number that changes during a run lives in a device tensor that the captured kernels read, never in a
kernel argument: the learning rates (dlrm.optim.RunOptimizer's `embedding_lr`, which the embedding kernels
read, and `lr_scale`, which the dense update reads), which train.lr_schedule writes in place (`fill_`)
between steps on the current stream, before the replay that uses them (dlrm.lr_schedule).

The capture follows PyTorch's whole-network recipe (torch.cuda.graphs docs): a few warm-up steps on a
side stream (autotuning, lazy initialization, optimizer state), gradients set to None, then capture. The
captured step is exactly `dlrm.step.train_step`. A graph has fixed shapes, so each batch size gets its
own: a size that comes after the warm-up (an epoch's last, partial batch) runs once uncaptured, which
compiles and tunes its kernels (that cannot happen inside a capture), is captured the next time it comes,
and replays from then on. Each graph keeps its own memory pool: a partial batch's graph adds at most the
activation memory of one full step.

Captures are thread-local (`kernels.launch.capture`): a loader's thread copies batches to the device while
training goes on, and under CUDA's default global capture mode any such call from another thread during a
capture (a new batch size's, an evaluation's) invalidates it. A background checkpoint's writer allocates
page-locked memory, which fails a capture in any mode: a capture waits for the writing to end
(dlrm.staging.CAPTURE_LOCK). Each owner of graphs (the
training step's, the evaluation's) captures on a stream of its own, not torch.cuda.graph's one shared
default: when a graph is destroyed PyTorch drops the cuBLAS workspace cached for its capture stream
(pytorch/pytorch#193402), which a live graph captured on the same stream still uses (a CUDA graph of an
earlier training in the process, freed during a later one's capture, failed that capture in
cublasSgemmStridedBatched).
"""

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from loguru import logger
from torch import Tensor

from dlrm.data.dataset import Batch
from dlrm.model import DLRM
from dlrm.optim import RunOptimizer
from dlrm.profiling import graph_replay_range
from dlrm.staging import CAPTURE_LOCK
from kernels.launch import capture

WARMUP_STEPS = 3


@contextlib.contextmanager
def _no_save_running():
    """Hold dlrm.staging.CAPTURE_LOCK (module docstring), with a log line when a background save makes the
    capture wait for it."""
    if not CAPTURE_LOCK.acquire(blocking=False):
        logger.info("a CUDA graph capture waits for the checkpoint being written in the background")
        CAPTURE_LOCK.acquire()
    try:
        yield
    finally:
        CAPTURE_LOCK.release()


def _on_side_stream(fn: Callable, *args):
    """``fn(*args)`` on a new side stream that first waits for the current stream, which then waits for it:
    how the CUDA graph docs run the uncaptured warm-up before a capture (lazy initialization there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    return result


class _Captured(NamedTuple):
    """One captured step: the graph, the inputs it reads (copy a batch into them) and the loss it writes."""

    graph: torch.cuda.CUDAGraph
    batch: Batch
    loss: Tensor


class GraphedTrainStep:
    """`train_step(model, optimizer, batch)` as a CUDA graph replay after `warmup` ordinary steps, one graph
    per batch size (module docstring).

    Args:
        model: the DLRM on a CUDA device (its embeddings updated in backward: sparse_kernel "triton").
        optimizer: the run's dlrm.optim.RunOptimizer.
        step_fn: the step to capture, `step_fn(model, optimizer, batch) -> loss` (dlrm.step.train_step).
        warmup: steps run uncaptured (on a side stream) before the first capture.
    Calling it as `step(model, optimizer, batch)` runs one training step and returns the loss, a 0-d device
    tensor that the next call of the same batch size overwrites (read or accumulate it before then).
    `capture_s`: the wall time of all captures; `graph`: the first captured graph (None before).
    """

    def __init__(self, model: DLRM, optimizer: RunOptimizer, step_fn, warmup: int = WARMUP_STEPS):
        self.model, self.optimizer, self.step_fn, self.warmup = model, optimizer, step_fn, warmup
        self.captured: dict[int, _Captured] = {}  # by batch size
        self.capture_stream: torch.cuda.Stream | None = None  # made at its first capture
        self.warmed: set[int] = set()  # batch sizes that ran uncaptured: their kernels are compiled
        self.steps = 0
        self.capture_s = 0.0

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return next(iter(self.captured.values())).graph if self.captured else None

    def replays(self, rows: int) -> bool:
        """Whether the next call with a batch of `rows` rows replays a captured graph; False when it runs a
        warm-up step (uncaptured: launched kernel by kernel, many times a replay's host time) or captures."""
        return rows in self.captured

    def __call__(self, model: DLRM, optimizer: RunOptimizer, batch: Batch) -> Tensor:
        """One training step on `batch` (the signature of train_step; model and optimizer must be the
        captured ones)."""
        if model is not self.model or optimizer is not self.optimizer:
            raise ValueError("GraphedTrainStep replays the model and optimizer it was built with")
        self.steps += 1
        rows = len(batch.label)
        captured = self.captured.get(rows)
        if captured is None and (self.steps <= self.warmup or rows not in self.warmed):
            self.warmed.add(rows)
            return self._side_stream_step(batch)
        if captured is None:
            captured = self.captured[rows] = self._capture(batch)
        else:
            for static, fresh in zip(captured.batch, batch, strict=True):
                static.copy_(fresh, non_blocking=True)
        with graph_replay_range():  # the profiled window's GPU time of the step (dlrm.profiling)
            captured.graph.replay()
        return captured.loss

    def _side_stream_step(self, batch: Batch) -> Tensor:
        return _on_side_stream(self.step_fn, self.model, self.optimizer, batch)

    def _capture(self, batch: Batch) -> _Captured:
        """Record one step on static copies of `batch` (recording runs nothing: the replay that follows
        performs this step)."""
        start = time.perf_counter()
        static = Batch(*(t.clone() for t in batch))
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        self.capture_stream = self.capture_stream or torch.cuda.Stream()
        with _no_save_running(), capture(graph, self.capture_stream):
            loss = self.step_fn(self.model, self.optimizer, static)
        took = time.perf_counter() - start
        self.capture_s += took
        logger.info(
            "captured the training step at batch size {} as a CUDA graph in {:.2f} s", len(batch.label), took
        )
        return _Captured(graph, static, loss)


class _CapturedForward(NamedTuple):
    graph: torch.cuda.CUDAGraph
    dense: Tensor
    sparse: Tensor
    logits: Tensor


class GraphedForward:
    """An evaluation forward `forward(dense, sparse) -> logits` as CUDA graph replays, one graph per batch
    size: the first call of a size runs it on a side stream (kernels compiled and tuned), the second
    captures it, and later calls copy the batch into the graph's inputs and replay.

    Why: launched from Python, evaluation is bound by host time, not by the GPU (the custom ops' launches
    take several times the kernels' GPU time). Evaluation pads its last batch to the batch size
    (dlrm.metrics.evaluate), so a split needs one graph.

    The graph reads the model's parameters where they are; training updates them in place (the optimizer, the
    fused embedding update, load_state_dict), so a replay always sees the current weights. Each graph
    keeps the forward's activations of its batch size in a memory pool of its own for the run.

    Args:
        forward: what to capture, e.g. ``functools.partial(dlrm.metrics.forward_logits, model, precision)``;
            it must run without a host sync (the model in eval mode under no_grad does).
    Returns of a call: the logits [B] (a tensor that the next call of the same size overwrites).
    """

    def __init__(self, forward: Callable[[Tensor, Tensor], Tensor]):
        self.forward = forward
        self.captured: dict[int, _CapturedForward] = {}
        self.capture_stream: torch.cuda.Stream | None = None  # made at its first capture
        self.warmed: set[int] = set()

    def __call__(self, dense: Tensor, sparse: Tensor) -> Tensor:
        rows = dense.shape[0]
        captured = self.captured.get(rows)
        if captured is None and rows not in self.warmed:
            self.warmed.add(rows)
            return _on_side_stream(self.forward, dense, sparse)
        if captured is None:
            dense, sparse = dense.clone(), sparse.clone()
            graph = torch.cuda.CUDAGraph()
            self.capture_stream = self.capture_stream or torch.cuda.Stream()
            with _no_save_running(), capture(graph, self.capture_stream):
                logits = self.forward(dense, sparse)
            logger.info("captured the evaluation forward at batch size {} as a CUDA graph", rows)
            captured = self.captured[rows] = _CapturedForward(graph, dense, sparse, logits)
        else:
            captured.dense.copy_(dense, non_blocking=True)
            captured.sparse.copy_(sparse, non_blocking=True)
        captured.graph.replay()
        return captured.logits
