"""The run configuration's sections: frozen dataclasses whose defaults are the defaults of a config file.

A config file (dlrm.config loads and validates it) is one JSON object with a top-level `name` and the
sections `data` (DataConfig), `model` (ModelConfig), `train` (TrainConfig), `profiler` (ProfilerConfig)
and `parallel` (ParallelConfig), each optional. The choices a key takes are listed in dlrm.choices.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MultiHotConfig:
    """Bags made on the fly from one-hot data (dlrm.data.bags): `distribution` "uniform" or "pareto" of
    the drawn ids (null: none made; the data's own bags, if any, are read), `seed` of the draws. The
    sizes are `model.multi_hot_sizes`."""

    distribution: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where the preprocessed data lives and how it is batched.

    `path` is a directory written by `python -m dlrm.data.preprocess` (train/, val/, test/ and
    metadata.json; dlrm.data.splits); a relative path is resolved against the working directory.
    `loader` reads the train split: "memory" (host tensors, a pinned copy per batch; dlrm.data.dataset),
    "gpu_resident" (the whole split in device memory, batches gathered on the device; dlrm.data.resident)
    "streaming" (parquet row groups read as needed, for splits larger than memory; dlrm.data.streaming)
    or "binary" (the fixed-width files of `python -m dlrm.data.binary`, read in windows into pinned memory
    and shuffled on the GPU: splits larger than memory at the step's speed; dlrm.data.binary_loader).
    The val and test splits are read whole, in batches of `eval_batch_size` (on a GPU held in device
    memory when they fit, else in host memory; dlrm.run.strategy's split_loader). `shuffle_buffer`: for
    "streaming" the rows mixed across row groups (0: rows shuffled within their row group only); for
    "binary" the rows of a window, read and shuffled together (at least 1; rounded down to a multiple of the
    batch).
    `prefetch` ("streaming" only): batches read ahead by a background thread (0: read in the training
    loop). `multi_hot`: bags of `model.multi_hot_sizes` made on the fly from one-hot data by every loader
    (MultiHotConfig).
    """

    path: str = "data/criteo_sample"
    batch_size: int = 128
    eval_batch_size: int = 4096
    shuffle: bool = True
    drop_last: bool = False
    loader: str = "memory"
    shuffle_buffer: int = 1_000_000
    prefetch: int = 4
    multi_hot: MultiHotConfig = field(default_factory=MultiHotConfig)


@dataclass(frozen=True)
class AttentionConfig:
    """The "attention" interaction (AutoInt): `layers` layers of multi-head self-attention over the F + 1
    feature vectors, `heads` heads of `dim` features each (dlrm.model.dlrm.InteractionArch)."""

    heads: int = 2
    layers: int = 2
    dim: int = 16


@dataclass(frozen=True)
class DcnConfig:
    """The "dcn" interaction (DCNv2's low-rank cross network): `layers` cross layers of rank `low_rank`
    over the (F + 1) D features (dlrm.model.dcn)."""

    layers: int = 3
    low_rank: int = 512


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on every MLP layer (`python -m dlrm.finetune`): rank 0 is off. With `rank` r > 0
    each layer is act(x W^T + (alpha / r) (x A^T) B^T + b) with W, b (and every other dense weight) frozen
    and A [r, K], B [N, r] trained (B starts at zero: the model starts as its base). `alpha` null means r
    (scale 1). `base`: the checkpoint whose weights (and table layout) the model starts from.
    `freeze_embeddings`: keep the embedding tables fixed too. Only with `mlp_block` "linear_act"."""

    rank: int = 0
    alpha: float | None = None
    base: str | None = None
    freeze_embeddings: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The model: DLRM (FB-DLRM Kaggle defaults) or its baseline floor, hashed logistic regression.

    `arch`: "dlrm" (dlrm.model.dlrm.DLRM) or "logistic" (dlrm.model.logistic: logit = bias + a linear layer
    over the dense features + one weight per table row of each sparse feature, on the same tables and
    hashing; no embeddings, MLPs or interaction, so the keys that shape those, `embedding_dim`, `bottom_mlp`,
    `top_mlp`, `interaction`, `mlp_block`, `gate`, `attention`, `dcn` and `lora`, must keep their defaults).
    `first_order`: add those first-order ("wide") terms to the DLRM logit (dlrm.model.first_order); they
    start at zero, so the model starts as the plain DLRM. A "logistic" model is those terms alone, with or
    without the key. Neither runs on many ranks yet (dlrm.parallel.run.check_world refuses them).
    `bottom_mlp` and `top_mlp` list layer widths without the input width: the bottom MLP reads the 13 dense
    features, the top MLP reads the interaction output. The bottom MLP's last width must equal
    `embedding_dim` and the top MLP's last width must be 1 (the logit).
    `table_rows`: rows per embedding table (26 ints); null takes each table's train cardinality + 1 from
    metadata.json. Either way rows are capped by `max_rows`. `hashing`: `modulus` maps a raw id x to
    (x + 1) % rows; `vocab` maps train ids exactly and unseen ids to one shared out-of-vocabulary row.
    `mlp_block`: what each layer of the bottom and top MLPs is (the logit layer stays a plain Linear):
    "linear_act" (Linear + ReLU), "ln_linear_gelu" (LayerNorm -> Linear -> GELU tanh) or "gated" (one
    Linear of twice the width, halves combined by `gate`: "sigmoid_tanh", "geglu" or "swiglu"; `gate` is
    read by "gated" only). See dlrm.model.mlp.
    `interaction`: "dot" (FB-DLRM's pairwise dot products), "cat" (concatenation) or "attention"
    (AutoInt-style self-attention over the feature vectors, shaped by `attention`: {heads, layers, dim};
    missing categorical values are masked out as keys) or "dcn" (DCNv2's low-rank cross network over the
    concatenated F + 1 vectors, shaped by `dcn`: {layers, low_rank}; dlrm.model.dcn). See
    dlrm.model.dlrm.InteractionArch.
    `embedding_dim`: D, the columns of every embedding table. `lora`: low-rank adapters on the MLP layers
    (LoraConfig; `python -m dlrm.finetune`).
    `multi_hot_sizes`: bag size of each sparse feature (26 ints >= 1; null or all ones: one id per feature),
    each bag pooled in its table by `pooling`, "sum" or "mean" (dlrm.model.pooling); the data holds the
    bags (`python -m dlrm.data.multi_hot`) or `data.multi_hot` makes them. Bags need `hashing` "modulus",
    no `first_order` and the "dot", "cat" or "dcn" interaction.
    `table_dtype`: the embedding tables' storage, "fp32" or "bf16" (dlrm.model.sparse). "bf16" halves the
    tables' bytes (memory, checkpoints, the planner's bytes per rank) and the lookups' traffic; the optimizer
    state stays fp32, each fused update is computed in fp32 and rounded stochastically to bf16 (unbiased,
    its random bits drawn from train.seed and a count the checkpoints hold), and the lookups return fp32
    (the autocast dtype under `train.precision` "bf16"). Needs `train.use_triton` (the fused updates round
    stochastically; the eager tables' torch optimizer would round every step to nearest). The first-order
    tables (D = 1) and, on many ranks, the replicated (data-parallel) tables stay fp32.
    """

    arch: str = "dlrm"
    first_order: bool = False
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    interaction: str = "dot"
    hashing: str = "modulus"
    table_rows: tuple[int, ...] | None = None
    max_rows: int = 10_000_000
    min_frequency: int = 1
    mlp_block: str = "linear_act"
    gate: str = "sigmoid_tanh"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    dcn: DcnConfig = field(default_factory=DcnConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    multi_hot_sizes: tuple[int, ...] | None = None
    pooling: str = "sum"
    table_dtype: str = "fp32"


@dataclass(frozen=True)
class LrScheduleConfig:
    """MLPerf DLRM's learning-rate schedule (dlrm.lr_schedule), a factor on `lr` and `embedding_lr` alike:
    linear warm-up from 0 over `warmup_steps` steps, constant, then a polynomial decay of power 2 over
    `decay_steps` steps from step `decay_start_step` down to 0 (0 from then on). The defaults (0, null, 0)
    keep the lr constant. `decay_start_step` (null: no decay) needs `decay_steps` > 0 and must not come
    before the warm-up's end. Works under `cuda_graphs`: the rates are device tensors the step reads."""

    warmup_steps: int = 0
    decay_start_step: int | None = None
    decay_steps: int = 0


@dataclass(frozen=True)
class TrainConfig:
    """Optimization and loop settings.

    `optimizer`: "sgd", "adagrad" or "rowwise_adagrad" (Adagrad with one accumulator per embedding-table
    row, the mean of the squared gradient over its D values, as FBGEMM / TorchRec's EXACT_ROWWISE_ADAGRAD:
    the tables' optimizer state is [rows] instead of [rows, D], on many ranks sharded and checkpointed like
    the tables' rows; the MLPs take plain Adagrad). dlrm.optim.
    `embedding_lr` defaults to `lr`; `lr_schedule` scales both over the steps (warm-up and decay,
    LrScheduleConfig; constant by default). `adagrad_eps`: Adagrad's eps, added to sqrt(sum) in the
    denominator, for the dense weights and the tables alike (the accumulators start at 0).
    `eval_interval` (steps) of null evaluates at each epoch's end only; `evals_per_epoch` n instead
    evaluates every ceil(steps per epoch / n) steps (MLPerf DLRM-DCNv2's cadence: 20 a pass over the data).
    `select_on`: the val metric that picks checkpoints/best.pt and that early stopping follows: "logloss"
    (lower is better; the default) or "auc" (higher is better). AUC ranks rows and is blind to calibration,
    so a model that predicts twice the click rate can win on it; logloss scores the probabilities.
    `patience`: stop after this many evaluations without a better `select_on` (null: never stop early).
    `use_torch_compile` compiles the dense part with Inductor, in `compile_mode` "default" or
    "reduce-overhead" (Inductor also captures the compiled part as CUDA graphs), or "auto" (the default):
    the one measured faster for the run, named in the log (dlrm.step.resolve_compile_mode).
    `use_triton` runs the model on our Triton kernels: table-batched embeddings whose backward applies the
    optimizer (any of the three) to the touched rows, the dot interaction, the loss, and the MLP layers, which
    `triton_mlp_kernel` picks: "linear_act" (GEMM + bias + activation fused) or "bias_act" (cuBLAS GEMM,
    then fused bias + activation), or "cuda_bias_act" (bias_act's CUDA C++ twin, built with nvcc on first
    use; CUDA only).
    Both flags may be set. `cuda_graphs` captures the whole training step once as a CUDA graph and
    replays it, and evaluations replay the forward as a graph too (dlrm.graphs); true needs `use_triton`,
    whose steps have no host sync (any optimizer), or `use_torch_compile` (the compiled dense part inside
    the graph, the tables plain PyTorch that update themselves in backward: RunConfig.sparse_kernel
    "torch_fused"; one id a feature, one rank).
    null (the default) takes it wherever it works: `use_triton` on CUDA devices (one or many ranks),
    `use_torch_compile` on one CUDA device, compile_mode "auto" or "default" (dlrm.step.resolve_cuda_graphs;
    the log says why when it cannot); false: never.
    `precision` of the training step's MLPs and interaction: "fp32", "tf32" (fp32 tensors, TF32 tensor-core
    matmuls) or "bf16" (autocast to bf16; fp32 master weights, embedding tables, loss and evaluation).
    `on_nonfinite`: what a NaN or infinite training loss does: "stop" the run (exit 3; last.pt stays the
    last finite state) or "skip_batch" (the step's update is not applied, on the device; counted).
    Checkpoints/last.pt is written every `checkpoint_interval` steps (null: not by steps) and every
    `checkpoint_every_s` seconds of wall time (null: not by time), at a step's end; `keep_last` older ones
    are kept beside it as checkpoints/step-<N>.pt (0: only last.pt). `checkpoint_policy`: which
    checkpoints the run keeps: "best_and_last" (last.pt, and best.pt, the checkpoint of the best val
    evaluation's step kept as a hard link, no second write), "last_only" (no best.pt) or "none" (nothing
    written: benchmarks); dlrm.run.checkpoints.
    """

    optimizer: str = "sgd"
    lr: float = 0.1
    embedding_lr: float | None = None
    adagrad_eps: float = 1e-10
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    weight_decay: float = 0.0
    epochs: int = 1
    max_steps: int | None = None
    log_interval: int = 50
    eval_interval: int | None = None
    evals_per_epoch: int | None = None
    select_on: str = "logloss"
    patience: int | None = None
    seed: int = 0
    device: str = "auto"
    use_torch_compile: bool = False
    compile_mode: str = "auto"
    use_triton: bool = False
    triton_mlp_kernel: str = "linear_act"
    cuda_graphs: bool | None = None
    precision: str = "fp32"
    on_nonfinite: str = "stop"
    checkpoint_interval: int | None = None
    checkpoint_every_s: float | None = 600.0
    keep_last: int = 0
    checkpoint_policy: str = "best_and_last"


@dataclass(frozen=True)
class ProfilerConfig:
    """torch.profiler schedule: skip `wait` steps, warm up `warmup`, record `active` (one cycle)."""

    enabled: bool = True
    wait: int = 5
    warmup: int = 2
    active: int = 3


@dataclass(frozen=True)
class ParallelConfig:
    """Many processes (`torchrun`, dlrm.parallel); ignored in a single process.

    `row_wise`: split tables larger than `row_wise_bytes` (bytes of weights + optimizer state; null: the
    total over the world size, an even share per rank, and then more rows wherever a rank would hold over a
    tenth more bytes than another: dlrm.parallel.planner) over several ranks by rows; false places every
    table whole on one rank (table-wise), which needs no more ranks than tables. `data_parallel_rows`:
    tables of at most this many rows are replicated on every rank (data parallel); null: the planner's cost
    model (tables whose gradient all-reduce moves fewer bytes than their exchange); 0: none. `exchange_dtype`:
    "auto" (the lookup's dtype), "fp32" or "bf16", the embedding vectors' and gradients' dtype on the wire.
    `overlap`: the tables' lookups and exchanges run on a side CUDA stream, overlapping the bottom MLP's
    forward and backward (dlrm.model.side_stream); false runs them in line.
    `timeout_s`: how long a collective may wait before the process group fails it, and how long a rank may
    go without a heartbeat before the others end the run (env DLRM_TIMEOUT_S overrides it).
    """

    row_wise: bool = True
    row_wise_bytes: int | None = None
    data_parallel_rows: int | None = None
    exchange_dtype: str = "auto"
    overlap: bool = True
    timeout_s: float = 300.0


@dataclass(frozen=True)
class RunConfig:
    name: str = "dlrm"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def backend(self) -> str:
        """Backend name: eager, compile, triton or triton+compile."""
        parts = [
            name
            for name, on in (("triton", self.train.use_triton), ("compile", self.train.use_torch_compile))
            if on
        ]
        return "+".join(parts) or "eager"

    @property
    def mlp_kernel(self) -> str:
        """How the model's MLP layers run (dlrm.choices.MLP_KERNELS)."""
        return self.train.triton_mlp_kernel if self.train.use_triton else "torch"

    @property
    def sparse_kernel(self) -> str:
        """How the embeddings, interaction and loss run (dlrm.choices.SPARSE_KERNELS): "triton" for
        use_triton; "torch_fused" for use_torch_compile with cuda_graphs (the whole-step graph needs tables
        that update themselves in backward, with no host sync); else "torch"."""
        t = self.train
        if t.use_triton:
            return "triton"
        return "torch_fused" if t.use_torch_compile and t.cuda_graphs else "torch"
