"""The embedding tables of the model (SparseArch): raw Criteo ids [B, F] -> hashing -> embeddings [B, F, D]
(glossary letters of dlrm.model.dlrm). DLRM looks its features up here, and so do the first-order terms
(dlrm.model.first_order, tables of D = 1). The kernel is imported where it is first called: Triton reads
TRITON_INTERPRET when a kernel module is imported, and a run on a CPU decides it after reading its config."""

import contextlib
import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from dlrm.choices import FUSED_UPDATE_KERNELS, HASHINGS, SPARSE_KERNELS
from dlrm.data.bags import is_one_hot
from dlrm.data.schema import NUM_SPARSE
from dlrm.model.fused_update import lookup as fused_lookup
from dlrm.model.pooling import BagPooling
from dlrm.model.tables import lookup_dtype, register_vocabularies, table_torch_dtype, vocabulary_rows

__all__ = ["SPARSE_KERNELS", "SparseArch", "init_tables"]

# The config's hashings and "index": ids that are rows already (SparseArch's docstring).
_HASHINGS = (*HASHINGS, "index")

# The rows of a table drawn from one generator by `init_tables` (a block; the last one of a table shorter).
INIT_BLOCK_ROWS = 1 << 16


def _block_seed(seed: int, table: int, block: int) -> int:
    """The generator seed of rows block * INIT_BLOCK_ROWS, ... of table `table` for run seed `seed`: a hash of
    the three (63 bits), so that nearby seeds, tables and blocks draw unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_tables(pieces: list[tuple[torch.Tensor, int, int, int]], seed: int) -> None:
    """Fill each (values [n, D] on any device, table f, rows_f, first row) of `pieces` with rows first ..
    first + n - 1 of table f's initial weights for `seed`: FB-DLRM's U(-sqrt(1/rows_f), sqrt(1/rows_f)),
    drawn on the CPU in blocks of INIT_BLOCK_ROWS rows, each block from its own generator seeded by (seed,
    f, block). A table's weights are thus the seed's alone: the same in one process, on every kernel and
    device, and on any number of ranks however the planner splits it (a row shard draws only the blocks it
    overlaps, on the CPU one block at a time, and keeps its rows). The blocks are drawn by
    torch.get_num_threads() threads; the global torch generator is not touched."""
    jobs = []
    for values, table, table_rows, first in pieces:
        n = values.shape[0]
        bound = (1.0 / table_rows) ** 0.5
        blocks = range(first // INIT_BLOCK_ROWS, (first + n - 1) // INIT_BLOCK_ROWS + 1) if n else range(0)
        jobs += [(values, table, bound, first, block) for block in blocks]

    def fill(job: tuple[torch.Tensor, int, float, int, int]) -> None:
        values, table, bound, first, block = job
        start = block * INIT_BLOCK_ROWS  # the block's first row in the table
        lo, hi = max(start, first), min(start + INIT_BLOCK_ROWS, first + values.shape[0])
        generator = torch.Generator().manual_seed(_block_seed(seed, table, block))
        drawn = torch.empty(hi - start, values.shape[1]).uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            values[lo - first : hi - first].copy_(drawn[lo - start :])

    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(jobs)))) as pool:
        list(pool.map(fill, jobs))


class SparseArch(nn.Module):
    """F embedding tables of D columns, looked up from raw Criteo ids.

    Hashing (ids are the raw 32-bit category values, -1 for missing):
    - "modulus": row = (x + 1) % rows_f (missing lands in row 0). Not FB-DLRM's mapping, which takes
      dictionary indices first: on raw hashed ids with rows_f = cardinality + 1 about 63% of distinct ids
      share a row with another.
    - "vocab": row = position of x in the sorted train values of feature f (the `vocabularies`, missing
      included as a value); ids not in the vocabulary share the last row, the out-of-vocabulary row.
      rows_f = len(vocabulary_f) + 1.
    - "index": the ids are rows already (another SparseArch's `hash_ids`), so a second set of tables
      shares the first one's vocabularies instead of holding a copy (the first-order tables of
      dlrm.model.first_order); rows must lie in [0, rows_f), which is not checked.

    `kernel` picks how the tables are held and updated:
    - "torch": F nn.Embedding tables with sparse gradients; a torch optimizer updates the looked-up rows.
    - "triton": one table-batched [sum of rows_f, D] weight (`weights`, table f from row offsets[f]) looked
      up by our one-launch kernel `kernels.embedding`, whose backward applies the optimizer to the touched
      rows itself (set it with `configure_optimizer`; no weight gradient is produced). Its weights are
      `table_dtype`, fp32 or bf16 (`model.table_dtype`): bf16 halves the tables' bytes and the lookups'
      traffic; the optimizer state stays fp32, each update is computed in fp32 and rounded stochastically
      to bf16 (`configure_optimizer`'s `rounding`), and lookups return fp32 (or the autocast dtype).
    - "torch_fused": "triton"'s table-batched fp32 weights and update in backward, in plain PyTorch ops of
      fixed shapes (dlrm.model.fused_update: index_select forward, the update by sort and index_add_): no
      host sync, so the whole step can be captured as one CUDA graph around the compiled dense part
      (`--use-torch-compile`). One id a feature only (no bags); lookups return fp32.
    Both initialize identically for a seed (`init_tables`: FB-DLRM's U(-sqrt(1/rows_f), sqrt(1/rows_f)),
    the same weights as the sharded tables of any number of ranks; bf16 tables hold them rounded to
    nearest) and save the same state_dict keys (`embeddings.<f>.weight`, in the tables' dtype), so
    checkpoints move between them (a bf16 checkpoint loads exactly into fp32 tables).

    Args:
        embedding_dim: D.
        table_rows: rows_f per table (F ints). Ignored for "vocab", which takes len(vocabulary) + 1.
        hashing: "modulus", "vocab" or "index".
        vocabularies: for "vocab", F sorted int64 tensors of known ids.
        kernel: "torch", "torch_fused" or "triton".
        multi_hot_sizes: F bag sizes (`model.multi_hot_sizes`; None or all ones: one id per feature); with
            bags, forward takes ids [B, S] (dlrm.data.bags) and pools each bag by `pooling` ("sum" or
            "mean"; dlrm.model.pooling), modulus hashing only.
        seed: the tables' initialization seed (the run's train.seed); None draws one from the global torch
            generator, so that torch.manual_seed decides.
        table_dtype: "fp32" or "bf16" (kernel "triton" only), the weights' dtype.
    Raises:
        ValueError: wrong number of tables or vocabularies, unknown hashing or kernel, bad bags, bags with
            kernel "torch_fused", bf16 tables with a kernel other than "triton".
    """

    def __init__(
        self,
        embedding_dim: int,
        table_rows: list[int] | None = None,
        hashing: str = "modulus",
        vocabularies: list[torch.Tensor] | None = None,
        kernel: str = "torch",
        multi_hot_sizes: tuple[int, ...] | None = None,
        pooling: str = "sum",
        seed: int | None = None,
        table_dtype: str = "fp32",
    ):
        super().__init__()
        if kernel not in SPARSE_KERNELS:
            raise ValueError(f"unknown sparse kernel {kernel!r}: expected one of {SPARSE_KERNELS}")
        dtype = table_torch_dtype(table_dtype, kernel)
        if not is_one_hot(multi_hot_sizes) and hashing != "modulus":
            raise ValueError(f"bags (model.multi_hot_sizes) need hashing 'modulus', got {hashing!r}")
        if not is_one_hot(multi_hot_sizes) and kernel == "torch_fused":
            raise ValueError("bags (model.multi_hot_sizes) need sparse kernel 'torch' or 'triton'")
        if hashing == "vocab":
            if vocabularies is None or len(vocabularies) != NUM_SPARSE:
                raise ValueError(f"hashing 'vocab' needs {NUM_SPARSE} vocabularies")
            table_rows = [len(v) + 1 for v in vocabularies]
            register_vocabularies(self, vocabularies)
        elif hashing not in _HASHINGS:
            raise ValueError(f"unknown hashing {hashing!r}: expected one of {_HASHINGS}")
        if table_rows is None or len(table_rows) != NUM_SPARSE:
            raise ValueError(f"expected {NUM_SPARSE} table sizes, got {table_rows!r}")
        self.hashing = hashing
        self.table_rows = list(table_rows)
        self.frozen = False  # fixed tables (LoRA fine-tuning with freeze_embeddings): no update, no gradient
        # A buffer, so hashing does not copy the sizes to the device every step.
        self.register_buffer("rows", torch.tensor(self.table_rows), persistent=False)
        self.kernel = kernel
        if kernel == "torch":
            self.embeddings = nn.ModuleList(
                nn.Embedding(rows, embedding_dim, sparse=True, _weight=torch.empty(rows, embedding_dim))
                for rows in table_rows
            )
            tables = [table.weight.data for table in self.embeddings]
        else:
            self.weights = nn.Parameter(torch.empty(sum(table_rows), embedding_dim, dtype=dtype))
            tables = list(self.weights.data.split(self.table_rows))
            offsets = torch.tensor([0, *self.table_rows[:-1]]).cumsum(0)
            self.register_buffer("offsets", offsets, persistent=False)
            self.register_buffer("optimizer_state", torch.zeros(0), persistent=False)
            # The update's learning rate, a 0-d fp32 tensor the kernel reads (configure_optimizer sets it).
            self.register_buffer("lr", torch.zeros(()), persistent=False)
            # bf16 tables: the (seed, count) of the update's stochastic rounding (configure_optimizer).
            self.rounding: torch.Tensor | None = None
            self.optimizer: tuple[str, float] | None = None  # (optimizer, eps), set by configure_optimizer
            self.register_state_dict_post_hook(_split_tables)
            self.register_load_state_dict_pre_hook(_join_tables)
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        init_tables([(table, f, table.shape[0], 0) for f, table in enumerate(tables)], seed)
        # No state: a checkpoint's keys are the same with and without bags.
        one_hot = is_one_hot(multi_hot_sizes)
        self.bags = None if one_hot else BagPooling(multi_hot_sizes, pooling, self.table_rows)

    def configure_optimizer(
        self,
        optimizer: str,
        lr: float | torch.Tensor,
        eps: float = 1e-10,
        rounding: torch.Tensor | None = None,
    ) -> None:
        """For kernels "triton" and "torch_fused": the update their backward applies, "sgd" or "adagrad"
        (torch.optim's semantics) or "rowwise_adagrad"; allocates the optimizer state next to the weights
        (call it after moving the module to its device). `lr` is the update's rate: a 0-d fp32 tensor on
        the weights' device, held as given (dlrm.optim.RunOptimizer shares one among the table sets and
        writes it in place as the schedule goes), or a number, held in a tensor of this module's own.
        `rounding`: for bf16 tables, the [2] int64 (seed, count) device tensor of the update's stochastic
        rounding, held as given (RunOptimizer advances its count once a step); None rounds bf16 updates to
        nearest.

        Raises:
            ValueError: kernel "torch" (its tables take a torch optimizer), or an unknown optimizer.
        """
        if self.kernel not in FUSED_UPDATE_KERNELS:
            raise ValueError(
                f"configure_optimizer is for kernels {FUSED_UPDATE_KERNELS}; give kernel 'torch' tables to a "
                "torch optimizer"
            )
        from kernels.embedding_update import optimizer_state

        self.optimizer_state = optimizer_state(self.weights.detach(), optimizer)
        if not isinstance(lr, torch.Tensor):
            lr = torch.full((), lr, dtype=torch.float32, device=self.weights.device)
        self.lr = lr
        self.optimizer = (optimizer, eps)
        self.rounding = rounding if self.weights.dtype == torch.bfloat16 else None

    def hash_ids(self, sparse: torch.Tensor) -> torch.Tensor:
        """Raw ids [B, F] int64 -> row indices [B, F] int64 within each table."""
        if self.hashing == "modulus":
            return torch.remainder(sparse + 1, self.rows)
        if self.hashing == "index":
            return sparse
        return vocabulary_rows(sparse, self.vocab_keys, self.vocab_starts, self.vocab_sizes, self.vocab_bases)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        """sparse: [B, F] int64 raw ids (with bags: [B, S], each bag pooled) -> embeddings [B, F, D]: kernel
        "torch" in the tables' dtype (fp32), kernel "triton" in `lookup_dtype` (fp32, or under autocast the
        autocast dtype, rounded by the kernel as it stores)."""
        if self.bags is not None:
            return self.bags(self, sparse)
        if self.kernel == "triton":
            from kernels.embedding import embedding_lookup

            # The kernel hashes modulus ids itself; vocab rows are looked up here first ("index": as given).
            ids, hashing = (
                (sparse, "modulus") if self.hashing == "modulus" else (self.hash_ids(sparse), "index")
            )
            if self.optimizer is None and torch.is_grad_enabled() and not self.frozen:
                raise ValueError(
                    "SparseArch(kernel='triton') updates its tables in backward: call configure_optimizer "
                    "before training (or look up under torch.no_grad())"
                )
            optimizer, eps = self.optimizer or ("sgd", 0.0)  # lookups only: lr 0, nothing is updated
            state, offsets = self.optimizer_state, self.offsets
            dtype = lookup_dtype(sparse.device)
            # Frozen tables: no backward, whose kernel would update them.
            with torch.no_grad() if self.frozen else contextlib.nullcontext():
                return embedding_lookup(
                    self.weights, state, offsets, self.rows, ids, hashing, optimizer, self.lr, eps, dtype,
                    self.rounding,
                )  # fmt: skip
        rows = self.hash_ids(sparse)
        if self.kernel == "torch_fused":
            return self._fused_lookup(rows)
        return torch.stack([table(rows[:, f]) for f, table in enumerate(self.embeddings)], dim=1)

    def _fused_lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """Kernel "torch_fused": rows [B, F] within each table -> [B, F, D] fp32, updated in backward."""
        index = rows + self.offsets
        if self.frozen or not torch.is_grad_enabled():
            return self.weights.detach()[index]
        if self.optimizer is None:
            raise ValueError(
                "SparseArch(kernel='torch_fused') updates its tables in backward: call configure_optimizer "
                "before training (or look up under torch.no_grad())"
            )
        optimizer, eps = self.optimizer
        return fused_lookup(self.weights, self.optimizer_state, index, optimizer, self.lr, eps)


def _split_tables(module: SparseArch, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook of the table-batched SparseArch: save per-table keys, as kernel "torch" does."""
    weights = state_dict.pop(prefix + "weights")
    for f, table in enumerate(weights.split(module.table_rows)):
        state_dict[f"{prefix}embeddings.{f}.weight"] = table


def _join_tables(module: SparseArch, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of the table-batched SparseArch: per-table keys -> one `weights` tensor."""
    keys = [f"{prefix}embeddings.{f}.weight" for f in range(len(module.table_rows))]
    if all(k in state_dict for k in keys):
        state_dict[prefix + "weights"] = torch.cat([state_dict.pop(k) for k in keys])
