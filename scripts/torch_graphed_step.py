"""The strongest plain-PyTorch DLRM training step: the baseline that the README's step ratios are stated
against (backend "torch-graphed" of scripts/bench_train.py; DESIGN.md, "Performance method").

Plain PyTorch only (no dlrm import, none of our kernels). One step, SGD, glossary letters of
dlrm/model/dlrm.py (B batch, F = 26 tables, D embedding dim, R = sum of the tables' rows):

    rows     = (sparse + 1) % rows_f + offset_f                     [B, F] i64 into ONE [R, D] f32 weight
    embedded = weight.index_select(0, rows.flatten()).view(B, F, D) a leaf of autograd (no [R, D] gradient)
    loss     = dense_loss(dense, embedded, label)                   bottom MLP, dot interaction, top MLP,
                                                                    mean BCE-with-logits; torch.compile'd
    g_emb, *g_mlp = torch.autograd.grad(loss, [embedded, *mlp_params])
    weight.index_add_(0, rows.flatten(), g_emb.reshape(-1, D), alpha=-embedding_lr) SGD on the touched rows
    torch._foreach_add_(mlp_params, g_mlp, alpha=-lr)        SGD on the MLPs (as torch.optim.SGD, foreach)

and all of it (lookup, compiled forward and backward, both updates) captured once into one CUDA graph
(warm-up steps on a side stream first, then capture on static input buffers) and replayed: one launch per
step, the host only copies the next batch into the static buffers. Compilation happens in the first
warm-up step and the capture in the first step after warm-up; both are outside a timed loop that follows
warm-up.

Numerics are those of dlrm.model.DLRM (sparse_kernel "torch", mlp_block "linear_act", interaction "dot",
hashing "modulus") trained by dlrm.step.train_step with SGD: the same ops in the same dtypes; precision
"bf16" runs the MLPs and the interaction under bf16 autocast as train_step does, the loss in fp32; rows
that occur several times in a batch sum their gradients, as nn.Embedding(sparse=True)'s gradient does in
torch.optim.SGD. tests/test_torch_graphed_step.py checks the loss and every updated weight against our
eager step on the CPU (uncompiled, uncaptured).

The step's precision flags and compiled code do not depend on what ran before it in the process: each
call (warm-up, capture, replay, an uncaptured step) runs under the process-wide flags its precision implies
(`precision_flags`: TF32 matmuls on for "tf32", off for "fp32" and "bf16", as dlrm.device.set_precision
sets them for our model) and gives the caller's flags back after it; a compiled step starts from fresh
dynamo state (torch._dynamo.reset() when it is built), so no earlier build's compiled code, recompilations
or dynamic-shape decisions carry over to it.

Left out: Adagrad, weight decay, other interactions, MLP blocks and hashings, several GPUs.
"""

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

PRECISIONS = ("fp32", "tf32", "bf16")
WARMUP_STEPS = 3


@contextmanager
def precision_flags(precision: str) -> Iterator[None]:
    """The block runs under the torch flags that `precision` (one of PRECISIONS) implies, whatever the caller
    set, and the caller's flags are back after it: TF32 tensor-core matmuls for "tf32" (cuBLAS:
    torch.backends.cuda.matmul.allow_tf32 and torch.set_float32_matmul_precision("high"); cuDNN:
    torch.backends.cudnn.allow_tf32), none for "fp32" and "bf16" ("highest"; bf16's autocast regions run
    in bf16 whatever these say, the rest in fp32). The fp32_precision properties are cleared first (the
    setters above write the ones they govern), so one the caller set cannot override them."""
    restore = flags_restorer()
    for backend in _precision_backends():
        backend.fp32_precision = "none"
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        restore()


@functools.cache
def _precision_backends() -> tuple:
    """The backends with an fp32_precision property, parents before children (oneDNN's matmul precision is
    part of the float32 matmul precision's state)."""
    b = torch.backends
    return (
        b,
        b.cuda.matmul,
        b.cudnn,
        b.cudnn.conv,
        b.cudnn.rnn,
        b.mkldnn,
        b.mkldnn.matmul,
        b.mkldnn.conv,
        b.mkldnn.rnn,
    )


def flags_restorer() -> Callable[[], None]:
    """A function that sets torch's fp32 precision flags back to their values now: the legacy ones (matmul
    and cuDNN allow_tf32, the float32 matmul precision), then the fp32_precision properties, which the
    legacy setters overwrite and which leave the legacy ones alone. Where torch refuses to read the legacy
    ones (the caller set the fp32_precision properties against them), only the properties go back."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        legacy = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    except RuntimeError:  # "you have used mix of the legacy and new APIs"
        legacy = None
    backends = _precision_backends()
    values = [backend.fp32_precision for backend in backends]

    def restore() -> None:
        if legacy is not None:
            matmul.allow_tf32, cudnn.allow_tf32 = legacy[:2]
            torch.set_float32_matmul_precision(legacy[2])  # after allow_tf32, which sets it too
        for backend, value in zip(backends, values, strict=True):
            backend.fp32_precision = value

    return restore


class PlainDLRM(nn.Module):
    """DLRM's weights and forward in plain PyTorch, the tables as one table-batched weight.

    Args:
        embedding_dim: D.
        bottom_mlp: widths of the bottom MLP (ReLU after every layer), the last one D.
        top_mlp: widths of the top MLP (ReLU between layers, the last a plain Linear), the last one 1.
        table_rows: rows_f of each of the F tables.
    Attributes:
        weight: [R, D] f32 buffer, table f at rows offsets[f] .. offsets[f] + rows_f (a buffer: the step
            updates it with index_add_, autograd never sees it).
        bottom, top: nn.ModuleList of nn.Linear.
    Initialization is FB-DLRM's, as our model's (tables U(-sqrt(1/rows_f), sqrt(1/rows_f)); Linear
    W ~ N(0, 2/(K+N)), b ~ N(0, 1/N)); `load_dlrm_state_dict` copies a dlrm.model.DLRM's weights instead.
    Raises:
        ValueError: bottom_mlp not ending in D, top_mlp not ending in 1, or no tables.
    """

    def __init__(
        self, embedding_dim: int, bottom_mlp: Sequence[int], top_mlp: Sequence[int], table_rows: Sequence[int]
    ):
        super().__init__()
        if not table_rows or bottom_mlp[-1] != embedding_dim or top_mlp[-1] != 1:
            raise ValueError(
                f"need tables, a bottom MLP ending in D={embedding_dim} and a top MLP ending in 1, got "
                f"{len(table_rows)} tables, bottom {list(bottom_mlp)}, top {list(top_mlp)}"
            )
        self.table_rows = [int(r) for r in table_rows]
        n = len(table_rows) + 1  # the F embeddings and the bottom MLP's output
        self.bottom = _linears(13, bottom_mlp)
        self.top = _linears(embedding_dim + n * (n - 1) // 2, top_mlp)
        self.register_buffer("weight", table_weight(self.table_rows, embedding_dim))
        self.register_buffer("rows", torch.tensor(self.table_rows))
        self.register_buffer("offsets", torch.tensor([0, *self.table_rows[:-1]]).cumsum(0))
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)

    @property
    def dense_modules(self) -> list[nn.ModuleList]:
        """The layers the dense optimizer updates."""
        return [self.bottom, self.top]

    def lookup_rows(self, sparse: torch.Tensor) -> torch.Tensor:
        """Raw ids [B, F] i64 (-1 missing) -> rows of `weight` [B, F] i64: modulus hashing, as our model."""
        return torch.remainder(sparse + 1, self.rows) + self.offsets

    def dense_loss(
        self, dense: torch.Tensor, embedded: torch.Tensor, label: torch.Tensor, bf16: bool = False
    ) -> torch.Tensor:
        """Mean BCE-with-logits, a 0-d f32 tensor, of dense [B, 13] f32 and embedded [B, F, D] f32 against
        label [B] f32; the MLPs and the interaction under bf16 autocast when `bf16`."""
        with torch.autocast(dense.device.type, torch.bfloat16, bf16):
            x = dense
            for layer in self.bottom:
                x = F.relu(layer(x))
            t = torch.cat([x.unsqueeze(1), embedded], dim=1)  # [B, F + 1, D]
            z = torch.bmm(t, t.transpose(1, 2))
            x = torch.cat([x, z[:, self.li, self.lj]], dim=1)  # strict lower triangle, row-major
            for i, layer in enumerate(self.top):
                x = layer(x) if i == len(self.top) - 1 else F.relu(layer(x))
        return F.binary_cross_entropy_with_logits(x.squeeze(1).float(), label)

    @torch.no_grad()
    def load_dlrm_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy the weights of a dlrm.model.DLRM state_dict (keys `sparse_arch.embeddings.<f>.weight`,
        `dense_arch.mlp.layers.<i>.*`, `over_arch.mlp.layers.<i>.*`).

        Raises:
            KeyError: a key is missing. RuntimeError: a shape differs.
        """
        tables = [state_dict[f"sparse_arch.embeddings.{f}.weight"] for f in range(len(self.table_rows))]
        self.weight.copy_(torch.cat(tables))
        for prefix, layers in (("dense_arch", self.bottom), ("over_arch", self.top)):
            for i, layer in enumerate(layers):
                layer.weight.copy_(state_dict[f"{prefix}.mlp.layers.{i}.weight"])
                layer.bias.copy_(state_dict[f"{prefix}.mlp.layers.{i}.bias"])


def table_weight(table_rows: Sequence[int], embedding_dim: int) -> torch.Tensor:
    """The tables as one [R, D] f32 weight, table f drawn from FB-DLRM's U(-sqrt(1/rows_f),
    sqrt(1/rows_f))."""
    weight = torch.empty(sum(table_rows), embedding_dim)
    for table in weight.split(list(table_rows)):
        bound = (1.0 / table.shape[0]) ** 0.5
        nn.init.uniform_(table, -bound, bound)
    return weight


def _linears(in_features: int, widths: Sequence[int]) -> nn.ModuleList:
    layers = nn.ModuleList(nn.Linear(k, n) for k, n in zip([in_features, *widths[:-1]], widths, strict=True))
    with torch.no_grad():
        for layer in layers:
            n, k = layer.weight.shape
            layer.weight.normal_(0.0, (2.0 / (k + n)) ** 0.5)
            layer.bias.normal_(0.0, (1.0 / n) ** 0.5)
    return layers


class TorchGraphedStep:
    """One SGD step of a PlainDLRM per call, `step(batch) -> loss` (module docstring).

    Args:
        model: the PlainDLRM, on the device that the batches are on.
        lr: SGD learning rate of the MLPs; embedding_lr that of the tables (None: lr).
        precision: "fp32", "tf32" or "bf16"; every call runs under its flags (`precision_flags`).
        compile: torch.compile the dense part (Inductor, default mode: the CUDA graph is ours), from fresh
            dynamo state (torch._dynamo.reset() here: process-wide, it drops every compiled function's code).
        cuda_graph: capture the whole step after `warmup` side-stream steps and replay it (CUDA only);
            a batch of another size than the captured one runs uncaptured.
    Calling it with a batch (dense [B, 13] f32, sparse [B, F] i64, label [B] f32; any sequence of the
    three, e.g. a dlrm Batch) returns the loss, a 0-d f32 device tensor that the next call may overwrite.
    `capture_s`: capture wall time (0 until captured).
    Raises:
        ValueError: an unknown precision, or cuda_graph with the model off CUDA.
    """

    def __init__(
        self,
        model: PlainDLRM,
        lr: float,
        embedding_lr: float | None = None,
        precision: str = "fp32",
        compile: bool = True,
        cuda_graph: bool = True,
        warmup: int = WARMUP_STEPS,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: expected one of {PRECISIONS}")
        if cuda_graph and model.weight.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the model on a CUDA device, it is on {model.weight.device}")
        self.model, self.lr, self.embedding_lr = model, lr, lr if embedding_lr is None else embedding_lr
        self.precision, self.bf16 = precision, precision == "bf16"
        self.params = [p for layers in model.dense_modules for p in layers.parameters()]
        if compile:
            torch._dynamo.reset()  # no earlier build's compiled code, recompile count or dynamic shapes
        self.dense_loss = torch.compile(model.dense_loss) if compile else model.dense_loss
        self.cuda_graph, self.warmup = cuda_graph, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.static_loss: torch.Tensor | None = None
        self.steps, self.capture_s = 0, 0.0

    def step(self, dense: torch.Tensor, sparse: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """One uncaptured step: lookup, dense part forward and backward, both SGD updates; the loss."""
        weight = self.model.weight
        rows = self.model.lookup_rows(sparse).flatten()  # [B * F]
        embedded = weight.index_select(0, rows).view(*sparse.shape, -1).requires_grad_()
        loss = self.dense_loss(dense, embedded, label, self.bf16)
        grad_rows, *grads = torch.autograd.grad(loss, [embedded, *self.params])
        with torch.no_grad():
            weight.index_add_(0, rows, grad_rows.reshape(rows.numel(), -1), alpha=-self.embedding_lr)
            torch._foreach_add_(self.params, grads, alpha=-self.lr)
        return loss.detach()

    def __call__(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        with precision_flags(self.precision):
            return self._call(*batch)

    def _call(self, dense: torch.Tensor, sparse: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if not self.cuda_graph:
            return self.step(dense, sparse, label)
        self.steps += 1
        if self.graph is None and self.steps <= self.warmup:
            # Warm-up (compilation, cuBLAS handles, the allocator) on a side stream, as the capture recipe.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.step(dense, sparse, label)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self._capture(dense, sparse, label)
        elif label.shape != self.static[2].shape:
            return self.step(dense, sparse, label)
        else:
            for static, fresh in zip(self.static, (dense, sparse, label), strict=True):
                static.copy_(fresh, non_blocking=True)
        self.graph.replay()
        return self.static_loss

    def _capture(self, dense: torch.Tensor, sparse: torch.Tensor, label: torch.Tensor) -> None:
        """Record one step on static copies of the batch (recording runs nothing: the replay that follows
        performs this step)."""
        start = time.perf_counter()
        self.static = [t.clone() for t in (dense, sparse, label)]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self.step(*self.static)
        self.capture_s = time.perf_counter() - start
