"""The DLRM model (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems"; layout of TorchRec's DLRM: DenseArch, SparseArch, InteractionArch, OverArch).

Glossary letters, used across the project:
    B        batch size (samples)
    F        sparse (categorical) features, 26 for Criteo
    D        embedding dim, also the bottom MLP's output width
    N_dense  dense features, 13 for Criteo
    M, N, K  GEMM sizes: [M, K] @ [K, N]

Forward: dense[B, N_dense] -> DenseArch -> [B, D]; sparse[B, F] raw ids -> hashing -> SparseArch -> [B, F, D];
InteractionArch -> [B, D + F(F+1)/2] ("dot"), [B, (F+1) D] ("cat", "dcn") or [B, (F+1) heads dim]
("attention"); OverArch -> logit[B]; with `model.first_order`, + the first-order terms [B]
(dlrm.model.first_order).
The model returns logits; the sigmoid is applied once, in evaluation/prediction. Kernels are imported where
they are first called (dlrm.model.sparse says why).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from dlrm.choices import FUSED_UPDATE_KERNELS, INTERACTIONS, SPARSE_KERNELS
from dlrm.config import AttentionConfig, DcnConfig, ModelConfig
from dlrm.data.schema import NUM_DENSE, NUM_SPARSE
from dlrm.model.dcn import LowRankCrossNet
from dlrm.model.first_order import FirstOrder
from dlrm.model.mlp import MLP
from dlrm.model.side_stream import SideStream
from dlrm.model.sparse import SparseArch


def _model_mlp(
    in_features: int,
    widths: tuple[int, ...],
    last_activation: str,
    block_last: bool,
    cfg: ModelConfig,
    kernel: str,
) -> MLP:
    """An MLP of the model: ReLU between layers, the block, gate and LoRA adapters of `cfg`."""
    return MLP(
        in_features, widths, "relu", last_activation, kernel, cfg.mlp_block, cfg.gate, block_last,
        cfg.lora.rank, cfg.lora.alpha,
    )  # fmt: skip


class DenseArch(nn.Module):
    """Bottom MLP over the dense features, ReLU after every layer (or every layer a `block`, see
    dlrm.model.mlp): [B, N_dense] f32 -> [B, D]. Its widths, block, gate and LoRA adapters are `cfg`'s
    (bottom_mlp, mlp_block, gate, lora); `mlp_kernel` as DLRM's."""

    def __init__(self, cfg: ModelConfig, mlp_kernel: str = "torch"):
        super().__init__()
        self.mlp = _model_mlp(NUM_DENSE, cfg.bottom_mlp, "relu", True, cfg, mlp_kernel)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class InteractionArch(nn.Module):
    """Feature interaction over the dense output [B, D] and the embeddings [B, F, D].

    "dot" (FB-DLRM's `interact_features`, self-interaction off): stack the F + 1 vectors as T [B, F+1, D],
    take Z = T @ T^T and keep the strict lower triangle Z[:, i, j], i > j, in row-major order
    (F(F+1)/2 = 351 products for F = 26); output [dense | products], [B, D + 351] (367 for D = 16).
    "cat": [dense | embeddings flattened], [B, (F + 1) D].
    "attention" (AutoInt, Song et al. 2019): `attention.layers` layers of multi-head self-attention over
    the F + 1 vectors T (`attention.heads` heads of `attention.dim` features each, E = heads * dim), each
        Q, K, V = T W_q, T W_k, T W_v   (one bias-free projection [E_in -> 3E], W_qkv)
        O = softmax(Q K^T / sqrt(dim) over the valid keys) V   per head, heads concatenated
        T' = relu(O + T W_res)   (W_res bias-free, only where E_in != E; else T itself, the residual)
    output T' flattened, [B, (F + 1) E]. A missing categorical value (raw id -1) is masked out as a key:
    no vector attends to the embedding row that missing ids hash to (its query still attends to the valid
    keys, and its output still goes to the top MLP); the dense vector is always valid, so every softmax has
    a key. The mask needs the raw ids (`forward`'s `sparse`); without them every key is valid.
    "dcn" (DCNv2, MLPerf's DLRM-DCNv2): `dcn.layers` low-rank cross layers (rank `dcn.low_rank`, parameters
    `cross.*`) over x0 = [dense | embeddings flattened], [B, (F + 1) D] in and out (dlrm.model.dcn; "triton"
    runs each layer as our fused cross-layer kernel, `kernels.cross`).
    `kernel` "triton" runs "dot" as our one-kernel interaction (`kernels.interaction`) and "attention"'s
    softmax(QK^T)V as our fused attention kernel (`kernels.attention`), forward and backward; "torch" runs
    F.scaled_dot_product_attention with the boolean key mask.
    """

    def __init__(
        self,
        embedding_dim: int,
        interaction: str = "dot",
        num_sparse: int = NUM_SPARSE,
        kernel: str = "torch",
        attention: AttentionConfig | None = None,
        dcn: DcnConfig | None = None,
    ):
        super().__init__()
        if kernel not in SPARSE_KERNELS:
            raise ValueError(f"unknown interaction kernel {kernel!r}: expected one of {SPARSE_KERNELS}")
        self.kernel = kernel
        if interaction not in INTERACTIONS:
            raise ValueError(f"unknown interaction {interaction!r}: expected one of {INTERACTIONS}")
        self.interaction = interaction
        n = num_sparse + 1
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        if interaction == "dot":
            self.out_features = embedding_dim + n * (n - 1) // 2
        elif interaction in ("cat", "dcn"):
            self.out_features = n * embedding_dim
            if interaction == "dcn":
                self.cross = LowRankCrossNet(self.out_features, dcn or DcnConfig(), kernel)
        else:
            attention = attention or AttentionConfig()
            self.heads, self.head_dim = attention.heads, attention.dim
            width = attention.heads * attention.dim
            widths = [embedding_dim] + [width] * attention.layers
            self.qkv = nn.ModuleList(nn.Linear(e, 3 * width, bias=False) for e in widths[:-1])
            self.residual = nn.ModuleList(
                nn.Linear(e, width, bias=False) if e != width else nn.Identity() for e in widths[:-1]
            )
            self.out_features = n * width

    def forward(
        self, dense: torch.Tensor, embedded: torch.Tensor, sparse: torch.Tensor | None = None
    ) -> torch.Tensor:
        """dense [B, D], embedded [B, F, D], sparse [B, F] raw ids (read by "attention" only, for its key
        mask) -> [B, out_features]."""
        if self.interaction == "cat":
            return torch.cat([dense, embedded.flatten(1)], dim=1)
        if self.interaction == "dcn":  # one dtype: under bf16 autocast the tables give fp32
            return self.cross(torch.cat([dense, embedded.to(dense.dtype).flatten(1)], dim=1))
        if self.interaction == "attention":
            return self._attention(dense, embedded, sparse)
        if self.kernel == "triton":
            from kernels.interaction import dot_interaction

            # Under bf16 autocast the bottom MLP gives bf16, the tables fp32: one dtype for the kernel.
            return dot_interaction(dense, embedded.to(dense.dtype))
        t = torch.cat([dense.unsqueeze(1), embedded], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        return torch.cat([dense, z[:, self.li, self.lj]], dim=1)

    def _attention(
        self, dense: torch.Tensor, embedded: torch.Tensor, sparse: torch.Tensor | None
    ) -> torch.Tensor:
        t = torch.cat([dense.unsqueeze(1), embedded.to(dense.dtype)], dim=1)  # [B, S = F + 1, D]
        b, s, _ = t.shape
        valid = torch.ones(b, s, dtype=torch.bool, device=t.device)
        if sparse is not None:
            valid = torch.cat([valid[:, :1], sparse != -1], dim=1)  # raw id -1: a missing value
        h, d = self.heads, self.head_dim
        for qkv, residual in zip(self.qkv, self.residual, strict=True):
            q, k, v = (u.transpose(1, 2) for u in qkv(t).view(b, s, 3, h, d).unbind(2))  # [B, H, S, d] views
            if self.kernel == "triton":
                from kernels.attention import masked_attention

                o = masked_attention(q, k, v, valid)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
            t = torch.relu(o.transpose(1, 2).reshape(b, s, h * d) + residual(t))
        return t.flatten(1)


class OverArch(nn.Module):
    """Top MLP, ReLU between layers (or every layer but the last a `block`, see dlrm.model.mlp) and a plain
    Linear last (the logit layer): [B, in_features] -> logit [B]. Its widths, block, gate and LoRA adapters
    are `cfg`'s (top_mlp, mlp_block, gate, lora); `mlp_kernel` as DLRM's."""

    def __init__(self, in_features: int, cfg: ModelConfig, mlp_kernel: str = "torch"):
        super().__init__()
        self.mlp = _model_mlp(in_features, cfg.top_mlp, "identity", False, cfg, mlp_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).squeeze(1)


class DLRM(nn.Module):
    """The full model: dense [B, N_dense] f32 and raw sparse ids [B, F] i64 -> logit [B] f32.

    Args:
        cfg: the model section of the run config.
        table_rows: rows per table (F ints), already resolved from config/metadata and capped.
        vocabularies: F sorted id tensors when cfg.hashing == "vocab".
        mlp_kernel: how MLP layers run: "torch", "bias_act" or "linear_act" (dlrm.model.mlp).
        sparse_kernel: how the embeddings, the interaction and the loss run: "torch", "torch_fused" (plain
            PyTorch, the tables updated in their lookups' backward: dlrm.model.sparse) or "triton" (our
            table-batched embedding with the fused optimizer update, interaction and loss kernels).
        sparse_arch: the embedding tables to use instead of building a SparseArch (the sharded tables of
            dlrm.parallel, same interface); table_rows and vocabularies are then unused.
        first_order_tables: with `cfg.first_order`, the D = 1 tables of the first-order terms to use (the
            sharded ones of dlrm.parallel); None: a SparseArch.
        overlap_sparse: run the embedding lookups on a side CUDA stream, overlapping the bottom MLP forward
            and backward (dlrm.model.side_stream; worth it where the lookups exchange between ranks).
        seed: the tables' initialization seed (SparseArch's; the run's train.seed). The tables never draw
            from the global torch generator (dlrm.model.sparse.init_tables), so the MLPs, which do, start
            from the same weights whether the tables are built here or given (`sparse_arch`, sharded).
    With `cfg.first_order` the logit gains the first-order terms (`first_order`, a FirstOrder on the same
    table sizes and hashing, vocab rows hashed once by `sparse_arch`; None without), built after every
    other module so that a seed initializes the rest as without them.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        table_rows: list[int] | None = None,
        vocabularies: list[torch.Tensor] | None = None,
        mlp_kernel: str = "torch",
        sparse_kernel: str = "torch",
        sparse_arch: nn.Module | None = None,
        first_order_tables: nn.Module | None = None,
        overlap_sparse: bool = False,
        seed: int | None = None,
    ):
        super().__init__()
        self.side_stream = SideStream(overlap_sparse)
        self.dense_arch = DenseArch(cfg, mlp_kernel)
        if sparse_arch is None:
            sparse_arch = SparseArch(
                cfg.embedding_dim,
                table_rows,
                cfg.hashing,
                vocabularies,
                sparse_kernel,
                cfg.multi_hot_sizes,
                cfg.pooling,
                seed,
                # The eager kernel (e.g. a bf16 run's checkpoint scored by `--backend eager`) holds fp32
                # tables: bf16 values load into them exactly. Training refuses the pair (dlrm.config).
                cfg.table_dtype if sparse_kernel == "triton" else "fp32",
            )
        self.sparse_arch = sparse_arch
        self.interaction_arch = InteractionArch(
            cfg.embedding_dim, cfg.interaction, kernel=sparse_kernel, attention=cfg.attention, dcn=cfg.dcn
        )
        self.over_arch = OverArch(self.interaction_arch.out_features, cfg, mlp_kernel)
        self.first_order = None
        if cfg.first_order:
            hashing = "modulus" if self.sparse_arch.hashing == "modulus" else "index"
            # No bias: the top MLP's logit layer has one.
            self.first_order = FirstOrder(
                self.sparse_arch.table_rows,
                hashing,
                kernel=sparse_kernel,
                bias=False,
                tables=first_order_tables,
            )
        if cfg.lora.rank:
            self.freeze_for_lora(cfg.lora.freeze_embeddings)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with record_function("embedding"), self.side_stream.branch(sparse.device):
            embedded = self.sparse_arch(sparse)
        with record_function("bottom_mlp"):
            dense_out = self.dense_arch(dense)
        embedded = self.side_stream.join(embedded)
        with record_function("interaction"):
            features = self.interaction_arch(dense_out, embedded, sparse)
        with record_function("top_mlp"):
            logit = self.over_arch(features)
        if self.first_order is None:
            return logit
        with record_function("first_order"):
            ids = (
                sparse if self.first_order.tables.hashing == "modulus" else self.sparse_arch.hash_ids(sparse)
            )
            return logit + self.first_order(dense, ids)  # fp32 (under bf16 autocast the MLP's logit is bf16)

    def start_at_base_rate(self, positive_rate: float) -> None:
        """Make the fresh model predict `positive_rate` (a click rate in (0, 1)) for every row: the logit
        layer's bias at its log-odds and its weights at zero (the first-order terms start at zero already).
        Training then starts at the base-rate loss instead of the loss of random logits around 0 (p = 0.5,
        far from a click rate of a few percent); the hidden layers get gradients from the second step on,
        once the logit layer's weights have moved. Raises ValueError as `log_odds`."""
        logit_layer = self.over_arch.mlp.layers[-1]
        with torch.no_grad():
            logit_layer.weight.zero_()
            logit_layer.bias.fill_(log_odds(positive_rate))

    def dense_modules(self) -> list[nn.Module]:
        """The modules of the dense parameters, which `--use-torch-compile` compiles (dlrm.step)."""
        modules = [self.dense_arch, self.interaction_arch, self.over_arch]
        return modules + ([self.first_order.dense] if self.first_order is not None else [])

    def table_archs(self) -> list[nn.Module]:
        """The embedding tables (SparseArch or its sharded twin), then the first-order tables if any."""
        return [self.sparse_arch] + ([self.first_order.tables] if self.first_order is not None else [])

    def dense_parameters(self) -> list[nn.Parameter]:
        """Trained parameters of the MLPs, of the interaction (the attention interaction's projections) and
        of the first-order dense layer: dense gradients. With LoRA adapters, the adapters only."""
        return [p for arch in self.dense_modules() for p in arch.parameters() if p.requires_grad]

    def freeze_for_lora(self, freeze_embeddings: bool) -> None:
        """Fine-tuning with adapters (model.lora): every dense weight but the adapters stops training, and
        the embedding tables too with `freeze_embeddings`."""
        for arch in self.dense_modules():
            for name, p in arch.named_parameters():
                p.requires_grad_(".lora_" in f".{name}")
        for tables in self.table_archs():
            tables.frozen = freeze_embeddings
            for p in tables.parameters():
                p.requires_grad_(not freeze_embeddings)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Embedding tables (and first-order tables) for a torch optimizer (sparse gradients); none for the
        "triton" and "torch_fused" sparse kernels, whose backward updates their tables itself
        (SparseArch.configure_optimizer)."""
        return embedding_parameters(self.table_archs())

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean BCE-with-logits of logits [B] against labels [B] (`bce_loss`)."""
        return bce_loss(logits, labels, self.sparse_arch.kernel)


def embedding_parameters(table_archs: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of the tables that a torch optimizer updates: not frozen; of the tables updated in
    their backward (kernels "triton" and "torch_fused": FUSED_UPDATE_KERNELS) only the replicated ones of a
    sharded model (dense gradients: `replicated_parameters`)."""
    return [
        p
        for arch in table_archs
        if not getattr(arch, "frozen", False)
        for p in (
            arch.parameters()
            if arch.kernel not in FUSED_UPDATE_KERNELS
            else getattr(arch, "replicated_parameters", list)()
        )
    ]


def log_odds(positive_rate: float) -> float:
    """log(p / (1 - p)), the logit whose sigmoid is p. Raises ValueError unless 0 < p < 1 (a split of one
    class has no finite log-odds, and nothing to rank)."""
    if not 0.0 < positive_rate < 1.0:
        raise ValueError(f"expected a click rate in (0, 1), got {positive_rate} (labels of one class only?)")
    return math.log(positive_rate / (1.0 - positive_rate))


def bce_loss(logits: torch.Tensor, labels: torch.Tensor, kernel: str) -> torch.Tensor:
    """Mean BCE-with-logits of logits [B] against labels [B] float: a 0-d fp32 tensor (computed in fp32;
    one fused kernel, forward and gradient, for `kernel` "triton")."""
    if kernel == "triton":
        from kernels.loss import bce_with_logits

        return bce_with_logits(logits, labels)
    return F.binary_cross_entropy_with_logits(logits.float(), labels)
