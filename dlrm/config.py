"""Run configuration: frozen dataclasses loaded from JSON with validation.

A config file is one JSON object with the sections `data`, `model`, `train`, `profiler` and `parallel`
(each optional, each defaulting to the values below) and a top-level `name`. Unknown keys and bad values
raise ValueError naming the key, e.g. `model.embedding_dim: expected a positive int, got 0`.
"""

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
ARCHS = ("dlrm", "logistic")
HASHINGS = ("modulus", "vocab")
LOADERS = ("memory", "gpu_resident", "streaming", "binary")
INTERACTIONS = ("dot", "cat", "attention")
MLP_BLOCKS = ("linear_act", "ln_linear_gelu", "gated")
GATES = ("sigmoid_tanh", "geglu", "swiglu")
OPTIMIZERS = ("sgd", "adagrad")
PRECISIONS = ("fp32", "tf32", "bf16")
COMPILE_MODES = ("default", "reduce-overhead")
TRITON_MLP_KERNELS = ("linear_act", "bias_act", "cuda_bias_act")
ON_NONFINITE = ("stop", "skip_batch")
SELECT_ON = ("logloss", "auc")


@dataclass(frozen=True)
class DataConfig:
    """Where the preprocessed data lives and how it is batched.

    `path` is a directory written by `python -m dlrm.data.preprocess` (train/, eval/, metadata.json);
    a relative path is resolved against the working directory.
    `loader` reads the train split: "memory" (host tensors, a pinned copy per batch; dlrm.data.dataset),
    "gpu_resident" (the whole split in device memory, batches gathered on the device; dlrm.data.resident)
    "streaming" (parquet row groups read as needed, for splits larger than memory; dlrm.data.streaming)
    or "binary" (the fixed-width files of `python -m dlrm.data.binary`, read in windows into pinned memory
    and shuffled on the GPU: splits larger than memory at the step's speed; dlrm.data.binary_loader).
    The eval split is always read by "memory". `shuffle_buffer`: for "streaming" the rows mixed across row
    groups (0: rows shuffled within their row group only); for "binary" the rows of a window, read and
    shuffled together (rounded down to a multiple of the batch). `prefetch` ("streaming" only): batches
    read ahead by a background thread (0: read in the training loop).
    """

    path: str = "data/criteo_sample"
    batch_size: int = 128
    eval_batch_size: int = 4096
    shuffle: bool = True
    drop_last: bool = False
    loader: str = "memory"
    shuffle_buffer: int = 1_000_000
    prefetch: int = 4


@dataclass(frozen=True)
class AttentionConfig:
    """The "attention" interaction (AutoInt): `layers` layers of multi-head self-attention over the F + 1
    feature vectors, `heads` heads of `dim` features each (dlrm.model.dlrm.InteractionArch)."""

    heads: int = 2
    layers: int = 2
    dim: int = 16


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
    `top_mlp`, `interaction`, `mlp_block`, `gate`, `attention` and `lora`, must keep their defaults).
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
    missing categorical values are masked out as keys). See dlrm.model.dlrm.InteractionArch.
    `embedding_dim`: D, the columns of every embedding table. `lora`: low-rank adapters on the MLP layers
    (LoraConfig; `python -m dlrm.finetune`).
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
    lora: LoraConfig = field(default_factory=LoraConfig)


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

    `embedding_lr` defaults to `lr`; `lr_schedule` scales both over the steps (warm-up and decay,
    LrScheduleConfig; constant by default). `eval_interval` (steps) of null evaluates at each epoch's end
    only.
    `select_on`: the val metric that picks checkpoints/best.pt and that early stopping follows: "logloss"
    (lower is better; the default) or "auc" (higher is better). AUC ranks rows and is blind to calibration,
    so a model that predicts twice the click rate can win on it; logloss scores the probabilities.
    `patience`: stop after this many evaluations without a better `select_on` (null: never stop early).
    `use_torch_compile` compiles the dense part with Inductor, in `compile_mode` "default" or
    "reduce-overhead" (Inductor also captures the compiled part as CUDA graphs). `use_triton` runs the
    model on our Triton kernels: table-batched embeddings whose backward applies the optimizer (SGD or
    Adagrad) to the touched rows, the dot interaction, the loss, and the MLP layers, which
    `triton_mlp_kernel` picks: "linear_act" (GEMM + bias + activation fused) or "bias_act" (cuBLAS GEMM,
    then fused bias + activation), or "cuda_bias_act" (bias_act's CUDA C++ twin, built with nvcc on first
    use; CUDA only).
    Both flags may be set. `cuda_graphs` captures the whole training step once as a CUDA graph and
    replays it, and evaluations replay the forward as a graph too (dlrm.graphs); true needs `use_triton`,
    whose steps have no host sync (either optimizer).
    null (the default) takes it wherever it works: `use_triton` on a CUDA device, one process,
    compile_mode "default" (dlrm.step.resolve_cuda_graphs; the log says why when it cannot); false: never.
    `precision` of the training step's MLPs and interaction: "fp32", "tf32" (fp32 tensors, TF32 tensor-core
    matmuls) or "bf16" (autocast to bf16; fp32 master weights, embedding tables, loss and evaluation).
    `on_nonfinite`: what a NaN or infinite training loss does: "stop" the run (exit 3; last.pt stays the
    last finite state) or "skip_batch" (the step's update is not applied, on the device; counted).
    Checkpoints/last.pt is written every `checkpoint_interval` steps (null: not by steps) and every
    `checkpoint_every_s` seconds of wall time (null: not by time), at a step's end; `keep_last` older ones
    are kept beside it as checkpoints/step-<N>.pt (0: only last.pt).
    """

    optimizer: str = "sgd"
    lr: float = 0.1
    embedding_lr: float | None = None
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    weight_decay: float = 0.0
    epochs: int = 1
    max_steps: int | None = None
    log_interval: int = 50
    eval_interval: int | None = None
    select_on: str = "logloss"
    patience: int | None = None
    seed: int = 0
    device: str = "auto"
    use_torch_compile: bool = False
    compile_mode: str = "default"
    use_triton: bool = False
    triton_mlp_kernel: str = "linear_act"
    cuda_graphs: bool | None = None
    precision: str = "fp32"
    on_nonfinite: str = "stop"
    checkpoint_interval: int | None = None
    checkpoint_every_s: float | None = 600.0
    keep_last: int = 0


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
    total over the world size, an even share per rank) over several ranks by rows; false places every table
    whole on one rank (table-wise), which needs no more ranks than tables. `timeout_s`: how long a
    collective may wait before the process group fails it, and how long a rank may go without a heartbeat
    before the others end the run (env DLRM_TIMEOUT_S overrides it).
    """

    row_wise: bool = True
    row_wise_bytes: int | None = None
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
        """How the model's MLP layers run (dlrm.model.mlp.MLP_KERNELS)."""
        return self.train.triton_mlp_kernel if self.train.use_triton else "torch"

    @property
    def sparse_kernel(self) -> str:
        """How the embeddings, interaction and loss run (dlrm.model.sparse.SPARSE_KERNELS)."""
        return "triton" if self.train.use_triton else "torch"


_SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "profiler": ProfilerConfig,
    "parallel": ParallelConfig,
}


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return `value` converted to the field's type, or raise ValueError naming `key`."""
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # JSON's Infinity / NaN, which Python's json module accepts
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    if annotation == tuple[int, ...]:
        if not isinstance(value, list | tuple) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise ValueError(f"{key}: expected a list of integers, got {value!r}")
        return tuple(value)
    if dataclasses.is_dataclass(annotation):  # a nested section, e.g. model.attention
        return _build(annotation, value, f"{key}.")
    if annotation in (bool | None, int | None, float | None, tuple[int, ...] | None, str | None):
        if value is None:
            return None
        inner = next(a for a in annotation.__args__ if a is not type(None))
        return _check_type(key, value, inner)
    raise TypeError(f"{key}: unsupported field type {annotation}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a JSON object, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown key (expected one of {', '.join(known)})")
    values = {}
    for name, value in raw.items():
        if prefix == "" and name in _SECTIONS:
            values[name] = _build(_SECTIONS[name], value, f"{name}.")
        else:
            values[name] = _check_type(prefix + name, value, known[name].type)
    return cls(**values)


def _require(ok: bool, key: str, expected: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{key}: expected {expected}, got {value!r}")


# What shapes DLRM's embeddings, MLPs and interaction, none of which a "logistic" model has.
_DLRM_ONLY = (
    "embedding_dim",
    "bottom_mlp",
    "top_mlp",
    "interaction",
    "mlp_block",
    "gate",
    "attention",
    "lora",
)


def _check_logistic(cfg: RunConfig) -> None:
    """model.arch "logistic": the DLRM-only keys keep their defaults (a value set there would be silently
    unused). Raises ValueError naming the first key that does not."""
    pairs = [(f"model.{k}", getattr(ModelConfig(), k), getattr(cfg.model, k)) for k in _DLRM_ONLY]
    for key, default, value in pairs:
        if dataclasses.is_dataclass(value):  # model.attention, model.lora: their fields join the loop
            pairs += [
                (f"{key}.{f.name}", getattr(default, f.name), getattr(value, f.name)) for f in fields(value)
            ]
            continue
        expected = f"its default {default!r} with model.arch 'logistic' (no embeddings, MLPs or interaction)"
        _require(value == default, key, expected, value)
    kernel = cfg.train.triton_mlp_kernel
    expected = f"its default {TrainConfig.triton_mlp_kernel!r} with model.arch 'logistic' (no MLPs)"
    _require(kernel == TrainConfig.triton_mlp_kernel, "train.triton_mlp_kernel", expected, kernel)
    # The first-order terms run outside autocast (dlrm.model.first_order): bf16 would change nothing.
    expected = "'fp32' or 'tf32' with model.arch 'logistic' (its terms are computed in fp32)"
    _require(cfg.train.precision != "bf16", "train.precision", expected, cfg.train.precision)


def validate(cfg: RunConfig) -> RunConfig:
    """Check values that types alone do not; return `cfg`. Raises ValueError naming the key."""
    d, m, t, p = cfg.data, cfg.model, cfg.train, cfg.profiler
    _require(bool(cfg.name) and "/" not in cfg.name, "name", "a non-empty name without '/'", cfg.name)
    _require(d.batch_size > 0, "data.batch_size", "a positive integer", d.batch_size)
    _require(d.eval_batch_size > 0, "data.eval_batch_size", "a positive integer", d.eval_batch_size)
    _require(d.loader in LOADERS, "data.loader", f"one of {LOADERS}", d.loader)
    _require(d.shuffle_buffer >= 0, "data.shuffle_buffer", "an integer >= 0 (rows)", d.shuffle_buffer)
    _require(d.prefetch >= 0, "data.prefetch", "an integer >= 0 (batches)", d.prefetch)
    _require(m.arch in ARCHS, "model.arch", f"one of {ARCHS}", m.arch)
    if m.arch == "logistic":  # first: its own message before the DLRM-only keys' checks
        _check_logistic(cfg)
    _require(m.embedding_dim > 0, "model.embedding_dim", "a positive integer", m.embedding_dim)
    for key, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
        _require(
            len(widths) > 0 and all(w > 0 for w in widths), key, "a non-empty list of positive widths", widths
        )
    _require(
        m.bottom_mlp[-1] == m.embedding_dim,
        "model.bottom_mlp",
        f"a last width equal to model.embedding_dim ({m.embedding_dim})",
        list(m.bottom_mlp),
    )
    _require(m.top_mlp[-1] == 1, "model.top_mlp", "a last width of 1 (the logit)", list(m.top_mlp))
    _require(m.interaction in INTERACTIONS, "model.interaction", f"one of {INTERACTIONS}", m.interaction)
    _require(m.hashing in HASHINGS, "model.hashing", f"one of {HASHINGS}", m.hashing)
    _require(m.mlp_block in MLP_BLOCKS, "model.mlp_block", f"one of {MLP_BLOCKS}", m.mlp_block)
    _require(m.gate in GATES, "model.gate", f"one of {GATES}", m.gate)
    a = m.attention
    _require(a.heads > 0, "model.attention.heads", "a positive integer", a.heads)
    _require(a.layers > 0, "model.attention.layers", "a positive integer", a.layers)
    _require(0 < a.dim <= 256, "model.attention.dim", "an integer in 1..256 (features per head)", a.dim)
    lora = m.lora
    _require(0 <= lora.rank <= 128, "model.lora.rank", "an integer in 0..128 (0: no adapters)", lora.rank)
    if lora.alpha is not None:
        _require(lora.alpha > 0, "model.lora.alpha", "a positive number or null", lora.alpha)
    if lora.rank:
        _require(m.mlp_block == "linear_act", "model.mlp_block", "'linear_act' with model.lora", m.mlp_block)
    else:
        _require(lora.base is None, "model.lora.base", "null without adapters (model.lora.rank 0)", lora.base)
    # Vocabularies are built from every train id in memory, which the streaming loaders never hold.
    _require(
        not (d.loader in ("streaming", "binary") and m.hashing == "vocab"),
        "data.loader",
        "'memory' or 'gpu_resident' with model.hashing 'vocab' (or set model.hashing 'modulus')",
        d.loader,
    )
    if m.table_rows is not None:
        _require(
            len(m.table_rows) == 26 and all(r > 0 for r in m.table_rows),
            "model.table_rows",
            "26 positive integers or null",
            m.table_rows,
        )
    _require(m.max_rows >= 2, "model.max_rows", "an integer >= 2", m.max_rows)
    _require(
        m.min_frequency >= 1, "model.min_frequency", "an integer >= 1 (train occurrences)", m.min_frequency
    )
    if m.min_frequency > 1:
        _require(m.hashing == "vocab", "model.hashing", "'vocab' with model.min_frequency > 1", m.hashing)
    _require(t.optimizer in OPTIMIZERS, "train.optimizer", f"one of {OPTIMIZERS}", t.optimizer)
    # Finite as well: configs built in Python skip _check_type.
    _require(0 < t.lr < math.inf, "train.lr", "a positive finite number", t.lr)
    if t.embedding_lr is not None:
        ok = 0 < t.embedding_lr < math.inf
        _require(ok, "train.embedding_lr", "a positive finite number or null", t.embedding_lr)
    validate_lr_schedule(t.lr_schedule)
    _require(0 <= t.weight_decay < math.inf, "train.weight_decay", "a finite number >= 0", t.weight_decay)
    _require(t.epochs > 0, "train.epochs", "a positive integer", t.epochs)
    for key, value in (
        ("train.max_steps", t.max_steps),
        ("train.eval_interval", t.eval_interval),
        ("train.patience", t.patience),
        ("train.checkpoint_interval", t.checkpoint_interval),
    ):
        if value is not None:
            _require(value > 0, key, "a positive integer or null", value)
    _require(t.log_interval > 0, "train.log_interval", "a positive integer", t.log_interval)
    _require(t.select_on in SELECT_ON, "train.select_on", f"one of {SELECT_ON}", t.select_on)
    _require(t.on_nonfinite in ON_NONFINITE, "train.on_nonfinite", f"one of {ON_NONFINITE}", t.on_nonfinite)
    if t.checkpoint_every_s is not None:
        ok = 0 < t.checkpoint_every_s < math.inf
        _require(ok, "train.checkpoint_every_s", "a positive number of seconds or null", t.checkpoint_every_s)
    _require(t.keep_last >= 0, "train.keep_last", "an integer >= 0", t.keep_last)
    _require(t.device in DEVICES, "train.device", f"one of {DEVICES}", t.device)
    _require(t.precision in PRECISIONS, "train.precision", f"one of {PRECISIONS}", t.precision)
    _require(t.compile_mode in COMPILE_MODES, "train.compile_mode", f"one of {COMPILE_MODES}", t.compile_mode)
    # The eager embeddings' sparse gradients are coalesced with a host sync: no CUDA graph can capture it.
    if t.cuda_graphs:
        _require(t.use_triton, "train.use_triton", "true with train.cuda_graphs (--use-triton)", t.use_triton)
        # Inductor's own CUDA graphs cannot be recorded inside the whole-step capture.
        mode = t.compile_mode
        _require(mode == "default", "train.compile_mode", "'default' with train.cuda_graphs", mode)
    _require(
        t.triton_mlp_kernel in TRITON_MLP_KERNELS,
        "train.triton_mlp_kernel",
        f"one of {TRITON_MLP_KERNELS}",
        t.triton_mlp_kernel,
    )
    for key, value in (("profiler.wait", p.wait), ("profiler.warmup", p.warmup)):
        _require(value >= 0, key, "an integer >= 0", value)
    _require(p.active > 0, "profiler.active", "a positive integer", p.active)
    par = cfg.parallel
    if par.row_wise_bytes is not None:
        _require(
            par.row_wise_bytes > 0,
            "parallel.row_wise_bytes",
            "a positive integer or null",
            par.row_wise_bytes,
        )
    _require(par.timeout_s > 0, "parallel.timeout_s", "a positive number (seconds)", par.timeout_s)
    return cfg


def validate_lr_schedule(schedule: LrScheduleConfig) -> None:
    """Raise ValueError naming the train.lr_schedule key whose value is bad."""
    key = "train.lr_schedule."
    warmup, start, steps = schedule.warmup_steps, schedule.decay_start_step, schedule.decay_steps
    _require(warmup >= 0, key + "warmup_steps", "an integer >= 0 (0: no warm-up)", warmup)
    _require(steps >= 0, key + "decay_steps", "an integer >= 0 (0: no decay)", steps)
    if start is None:
        _require(steps == 0, key + "decay_start_step", f"the step where the {steps} decay steps start", start)
        return
    # As MLPerf's LRPolicyScheduler: the warm-up must end before the decay starts.
    expected = f"an integer >= warmup_steps ({warmup}) or null"
    _require(start >= warmup, key + "decay_start_step", expected, start)
    _require(steps > 0, key + "decay_steps", "a positive integer with decay_start_step set", steps)


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a parsed JSON object. Raises ValueError naming the bad key."""
    return validate(_build(RunConfig, raw, ""))


def load_config(path: str | Path) -> RunConfig:
    """Load a JSON config file. Raises ValueError naming the file and the bad key or JSON position."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a JSON config file (configs/*.json)") from None
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file, expected a JSON config") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    try:
        return from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def replace(cfg: RunConfig, section: str, **changes: Any) -> RunConfig:
    """Return a validated copy of `cfg` with fields of one section changed (used by CLI overrides)."""
    return validate(
        dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})
    )
