"""The strongest plain-PyTorch DLRM-DCNv2 training step: the "torch-graphed" baseline of
scripts/bench_train.py for configs with bags and the "dcn" interaction (MLPerf DLRM-DCNv2,
configs/dlrm_dcnv2.json).

Plain PyTorch only (no dlrm import, none of our kernels). One step, Adagrad for every parameter, glossary
letters of dlrm/model/dlrm.py (B batch, F = 26 tables, D embedding dim, k_f bag sizes, S = sum of k_f, R the
tables' rows together, N = (F + 1) D, r the cross layers' rank):

    rows    = (bags + 1) % rows_f(c) + offset_f(c)           [B, S] i64 into ONE [R, D] f32 weight
    pooled  = F.embedding_bag(rows, weight, "sum")            [B, F, D], a leaf of autograd (no [R, D] grad)
    loss    = dense_loss(dense, pooled, label)                bottom MLP, x0 = [bottom | pooled flattened],
                                                              L layers x_{l+1} = x0 * (U_l (V_l x_l) + b_l)
                                                              + x_l, top MLP, mean BCE-with-logits;
                                                              torch.compile'd
    g_pooled, *g_dense = torch.autograd.grad(loss, [pooled, *dense_params])
    tables: exact Adagrad on the touched rows, each once: torch.sort of the B*S rows numbers the distinct
            rows (segments); each lookup's gradient g_pooled[b, f(c)] summed into its segment's slot by
            index_add_, each slot's row gathered, updated and scattered back by index_select / index_copy_
            (slots past the last segment point at a spare row and change nothing); fixed shapes; all of it
            but the sort torch.compile'd
    dense:  Adagrad by torch._foreach ops (torch.optim.Adagrad's update, lr_decay 0, initial accumulator 0)

and all of it captured once into one CUDA graph and replayed (TorchGraphedStep's recipe: warm-up steps on a
side stream, then the capture on static input buffers).

Numerics are those of dlrm.model.DLRM (sparse_kernel "torch", interaction "dcn", pooling "sum", hashing
"modulus", mlp_block "linear_act") trained by dlrm.step.train_step with train.optimizer "adagrad": the same
ops in the same dtypes ("bf16": the MLPs and cross layers under bf16 autocast, the loss in fp32); a row that
several lookups touch takes one step with their summed gradient, as the sparse gradient of
F.embedding_bag(sparse=True) does in our Adagrad. tests/test_torch_graphed_dcn.py checks the loss and every
updated weight against our eager step on the CPU (uncompiled, uncaptured).

Left out: SGD and row-wise Adagrad, weight decay, mean pooling, other hashings, several GPUs.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch_graphed_step import WARMUP_STEPS, TorchGraphedStep, _linears, table_weight


class PlainDCN(nn.Module):
    """DLRM-DCNv2's weights and forward in plain PyTorch, the tables as one table-batched weight (and a
    spare row that unused update slots write to).

    Args:
        embedding_dim: D.
        bottom_mlp: widths of the bottom MLP (ReLU after every layer), the last one D.
        top_mlp: widths of the top MLP (ReLU between layers, the last a plain Linear), the last one 1.
        table_rows: rows_f of each of the F tables.
        bag_sizes: k_f of each table (F ints >= 1).
        layers, low_rank: L cross layers of rank r.
    Attributes:
        weight: [R + 1, D] f32 buffer, table f at rows offsets[f] .. offsets[f] + rows_f, row R the spare
            (never looked up); state its Adagrad accumulator [R + 1, D] f32 (buffers: the step updates
            them, autograd never sees them).
        bottom, top: nn.ModuleList of nn.Linear; v, u: the cross layers' nn.Linear (V_l [r, N] without bias,
            U_l [N, r] with b_l).
    `load_dlrm_state_dict` copies a dlrm.model.DLRM's weights (the initialization here is only a start).
    Raises:
        ValueError: bottom_mlp not ending in D, top_mlp not ending in 1, or bag sizes that do not match the
            tables.
    """

    def __init__(
        self,
        embedding_dim: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        table_rows: Sequence[int],
        bag_sizes: Sequence[int],
        layers: int,
        low_rank: int,
    ):
        super().__init__()
        if len(bag_sizes) != len(table_rows) or min(bag_sizes) < 1:
            raise ValueError(f"need a bag size >= 1 per table, got {list(bag_sizes)}")
        if bottom_mlp[-1] != embedding_dim or top_mlp[-1] != 1:
            raise ValueError(
                f"need a bottom MLP ending in D={embedding_dim} and a top MLP ending in 1, got bottom "
                f"{list(bottom_mlp)}, top {list(top_mlp)}"
            )
        self.table_rows, self.bag_sizes = [int(r) for r in table_rows], [int(k) for k in bag_sizes]
        width = (len(table_rows) + 1) * embedding_dim
        self.bottom = _linears(13, bottom_mlp)
        self.v = nn.ModuleList(nn.Linear(width, low_rank, bias=False) for _ in range(layers))
        self.u = nn.ModuleList(nn.Linear(low_rank, width) for _ in range(layers))
        self.top = _linears(width, top_mlp)
        spare = torch.zeros(1, embedding_dim)
        self.register_buffer("weight", torch.cat([table_weight(self.table_rows, embedding_dim), spare]))
        self.register_buffer("state", torch.zeros_like(self.weight))
        sizes = torch.tensor(self.bag_sizes)
        offsets = torch.tensor([0, *self.table_rows[:-1]]).cumsum(0)
        self.register_buffer("column_rows", torch.tensor(self.table_rows).repeat_interleave(sizes))
        self.register_buffer("column_offsets", offsets.repeat_interleave(sizes))
        self.register_buffer("features", torch.arange(len(self.bag_sizes)).repeat_interleave(sizes))
        self.register_buffer("starts", sizes.cumsum(0) - sizes)

    @property
    def dense_modules(self) -> list[nn.ModuleList]:
        """The layers the dense optimizer updates, in load_dlrm_state_dict's order."""
        return [self.bottom, self.v, self.u, self.top]

    def lookup_rows(self, bags: torch.Tensor) -> torch.Tensor:
        """Raw ids [B, S] i64 (-1 missing) -> rows of `weight` [B, S] i64: modulus hashing, as our model."""
        return torch.remainder(bags + 1, self.column_rows) + self.column_offsets

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [B, S] -> the summed bags [B, F, D] f32 (each sample's bags are consecutive columns)."""
        b, s = rows.shape
        bag_offsets = (torch.arange(b, device=rows.device)[:, None] * s + self.starts).reshape(-1)
        pooled = F.embedding_bag(rows.reshape(-1), self.weight, bag_offsets, mode="sum")
        return pooled.view(b, len(self.bag_sizes), -1)

    def dense_loss(
        self, dense: torch.Tensor, pooled: torch.Tensor, label: torch.Tensor, bf16: bool = False
    ) -> torch.Tensor:
        """Mean BCE-with-logits, a 0-d f32 tensor, of dense [B, 13] f32 and pooled [B, F, D] f32 against
        label [B] f32; the MLPs and the cross layers under bf16 autocast when `bf16`."""
        with torch.autocast(dense.device.type, torch.bfloat16, bf16):
            x = dense
            for layer in self.bottom:
                x = F.relu(layer(x))
            x0 = torch.cat([x, pooled.to(x.dtype).flatten(1)], dim=1)  # [B, N], one dtype as our model
            x = x0
            for v, u in zip(self.v, self.u, strict=True):
                x = x0 * u(v(x)) + x
            for i, layer in enumerate(self.top):
                x = layer(x) if i == len(self.top) - 1 else F.relu(layer(x))
        return F.binary_cross_entropy_with_logits(x.squeeze(1).float(), label)

    @torch.no_grad()
    def load_dlrm_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy the weights of a dlrm.model.DLRM state_dict (keys `sparse_arch.embeddings.<f>.weight`,
        `dense_arch.mlp.layers.<i>.*`, `interaction_arch.cross.{v,u}.<l>.*`, `over_arch.mlp.layers.<i>.*`).

        Raises:
            KeyError: a key is missing. RuntimeError: a shape differs.
        """
        tables = [state_dict[f"sparse_arch.embeddings.{f}.weight"] for f in range(len(self.table_rows))]
        self.weight[:-1].copy_(torch.cat(tables))
        prefixes = ("dense_arch.mlp.layers", "interaction_arch.cross.v", "interaction_arch.cross.u")
        for prefix, layers in zip((*prefixes, "over_arch.mlp.layers"), self.dense_modules, strict=True):
            for i, layer in enumerate(layers):
                for name, p in layer.named_parameters():
                    p.copy_(state_dict[f"{prefix}.{i}.{name}"])


def segments(rows: torch.Tensor, spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment of each lookup [n] i64, row of each slot [n] i64) of the looked-up `rows` [n]: a segment is
    a distinct row, numbered in sorted order; slots past the last segment hold `spare`. Fixed shapes, no
    host sync (CUDA-graph capturable)."""
    sorted_rows, order = torch.sort(rows)
    head = torch.ones_like(sorted_rows, dtype=torch.bool)
    head[1:] = sorted_rows[1:] != sorted_rows[:-1]
    segment = torch.cumsum(head, 0) - 1
    lookup_segment = torch.empty_like(segment).scatter_(0, order, segment)
    slot_rows = torch.full_like(sorted_rows, spare).scatter_(0, segment, sorted_rows)
    return lookup_segment, slot_rows


def adagrad_rows_(
    weight: torch.Tensor,
    state: torch.Tensor,
    grad_pooled: torch.Tensor,
    features: torch.Tensor,
    lookup_segment: torch.Tensor,
    slot_rows: torch.Tensor,
    lr: float,
    eps: float,
) -> None:
    """Adagrad on the rows of `weight` [R + 1, D] (and its accumulator `state` [R + 1, D]) that the lookups
    touched, each row once with the sum of its lookups' gradients, in place: lookup (b, c)'s gradient is
    grad_pooled[b, features[c]] (grad_pooled [B, F, D] f32, features [S]); lookup_segment and slot_rows
    [B * S] as `segments` gives them. An unused slot adds zero to the spare row R: its values stay."""
    d = grad_pooled.shape[-1]
    per_lookup = grad_pooled.index_select(1, features).reshape(-1, d)
    sums = torch.zeros_like(per_lookup).index_add_(0, lookup_segment, per_lookup)
    s = state.index_select(0, slot_rows).addcmul_(sums, sums)
    state.index_copy_(0, slot_rows, s)
    w = weight.index_select(0, slot_rows).addcdiv_(sums, s.sqrt_().add_(eps), value=-lr)
    weight.index_copy_(0, slot_rows, w)


class TorchGraphedDCNStep(TorchGraphedStep):
    """One Adagrad step of a PlainDCN per call, `step(batch) -> loss` (module docstring); the warm-up, the
    capture and the replays are TorchGraphedStep's.

    Args:
        model: the PlainDCN, on the device that the batches are on.
        lr: Adagrad learning rate of the dense parameters; embedding_lr that of the tables (None: lr).
        eps: Adagrad's epsilon (train.adagrad_eps).
        precision, compile, cuda_graph, warmup: as TorchGraphedStep's.
    Calling it with a batch (dense [B, 13] f32, bags [B, S] i64, label [B] f32) returns the loss.
    Raises:
        ValueError: an unknown precision, or cuda_graph with the model off CUDA.
    """

    def __init__(
        self,
        model: PlainDCN,
        lr: float,
        embedding_lr: float | None = None,
        eps: float = 1e-10,
        precision: str = "fp32",
        compile: bool = True,
        cuda_graph: bool = True,
        warmup: int = WARMUP_STEPS,
    ):
        super().__init__(model, lr, embedding_lr, precision, compile, cuda_graph, warmup)
        self.eps = eps
        self.sums = [torch.zeros_like(p) for p in self.params]  # Adagrad's accumulators
        self.update_rows = torch.compile(adagrad_rows_) if compile else adagrad_rows_

    def step(self, dense: torch.Tensor, bags: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """One uncaptured step: pooled lookup, dense part forward and backward, both Adagrad updates."""
        model = self.model
        rows = model.lookup_rows(bags)
        pooled = model.pool(rows).requires_grad_()
        loss = self.dense_loss(dense, pooled, label, self.bf16)
        grad_pooled, *grads = torch.autograd.grad(loss, [pooled, *self.params])
        with torch.no_grad():
            lookup_segment, slot_rows = segments(rows.reshape(-1), spare=len(model.weight) - 1)
            self.update_rows(
                model.weight, model.state, grad_pooled, model.features, lookup_segment, slot_rows,
                self.embedding_lr, self.eps,
            )  # fmt: skip
            torch._foreach_addcmul_(self.sums, grads, grads)
            std = torch._foreach_sqrt(self.sums)
            torch._foreach_add_(std, self.eps)
            torch._foreach_addcdiv_(self.params, grads, std, value=-self.lr)
        return loss.detach()
