"""Run configuration: load a JSON config file, apply command-line overrides, validate.

    cfg = load_config("configs/tiny.json")                       # RunConfig (dlrm.config_sections)
    cfg = apply_overrides(cfg, ["train.lr=0.05", "model.embedding_dim=32"])      # `--set KEY=VALUE`

A config file is one JSON object with a top-level `name` and the sections `data`, `model`, `train`,
`profiler` and `parallel` (each optional, each defaulting to the dataclasses' values). Unknown keys and bad
values raise ValueError naming the key, e.g. `model.embedding_dim: expected a positive integer, got 0`; the
same checks judge a config file, a `--set` override and a config built in Python (`validate`).
"""

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from dlrm.choices import (
    ARCHS,
    BAG_DISTRIBUTIONS,
    CHECKPOINT_POLICIES,
    COMPILE_MODES,
    DEVICES,
    EXCHANGE_DTYPES,
    GATES,
    HASHINGS,
    INTERACTIONS,
    LOADERS,
    MLP_BLOCKS,
    ON_NONFINITE,
    OPTIMIZERS,
    POOLINGS,
    PRECISIONS,
    SELECT_ON,
    TABLE_DTYPES,
    TRITON_MLP_KERNELS,
)
from dlrm.config_sections import (
    AttentionConfig,
    DataConfig,
    DcnConfig,
    LoraConfig,
    LrScheduleConfig,
    ModelConfig,
    MultiHotConfig,
    ParallelConfig,
    ProfilerConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [  # the sections are importable from here too, beside what loads them
    "AttentionConfig",
    "DataConfig",
    "DcnConfig",
    "LoraConfig",
    "LrScheduleConfig",
    "ModelConfig",
    "MultiHotConfig",
    "ParallelConfig",
    "ProfilerConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "replace",
    "validate",
]

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
    "dcn",
    "lora",
    "table_dtype",
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


# model.multi_hot_sizes' bounds: a bag's ids (MLPerf DLRM-DCNv2's largest bag holds 100), and a batch's ids
# [B, sum of bag sizes] int64, which the bag kernels index with 32-bit positions (16 GiB of ids at the bound).
MAX_BAG_SIZE = 65_536
MAX_BATCH_IDS = 2**31 - 1


def _check_multi_hot(cfg: RunConfig) -> None:
    """model.multi_hot_sizes, model.pooling and data.multi_hot (dlrm.data.bags). Raises ValueError naming
    the key."""
    m, made = cfg.model, cfg.data.multi_hot
    _require(m.pooling in POOLINGS, "model.pooling", f"one of {POOLINGS}", m.pooling)
    sizes = m.multi_hot_sizes
    if sizes is not None:
        ok = len(sizes) == 26 and all(k >= 1 for k in sizes)
        _require(ok, "model.multi_hot_sizes", "26 integers >= 1 (bag sizes of C1..C26) or null", sizes)
        big = next(((f, k) for f, k in enumerate(sizes, 1) if k > MAX_BAG_SIZE), None)
        if big is not None:
            raise ValueError(
                f"model.multi_hot_sizes: expected bags of at most {MAX_BAG_SIZE:,} ids, got {big[1]:,} for "
                f"C{big[0]}"
            )
        ids = sum(sizes)  # a sample's; a batch holds [B, ids] int64
        for key, rows in (
            ("data.batch_size", cfg.data.batch_size),
            ("data.eval_batch_size", cfg.data.eval_batch_size),
        ):
            if rows * ids > MAX_BATCH_IDS:
                raise ValueError(
                    f"model.multi_hot_sizes: expected at most {MAX_BATCH_IDS:,} ids a batch, got {key} "
                    f"{rows:,} x {ids:,} ids a sample = {rows * ids:,} (lower {key} or the bag sizes)"
                )
    one_hot = sizes is None or all(k == 1 for k in sizes)
    if made.distribution is not None:
        expected = f"null or one of {BAG_DISTRIBUTIONS}"
        _require(
            made.distribution in BAG_DISTRIBUTIONS, "data.multi_hot.distribution", expected, made.distribution
        )
        expected = "bag sizes above 1 with data.multi_hot (the bags it makes)"
        _require(not one_hot, "model.multi_hot_sizes", expected, sizes)
    if one_hot:
        return
    # What reads one id per feature: the vocabularies, the first-order tables, the attention key mask.
    for key, value, default in (
        ("model.arch", m.arch, "dlrm"),
        ("model.hashing", m.hashing, "modulus"),
        ("model.first_order", m.first_order, False),
    ):
        _require(value == default, key, f"{default!r} with model.multi_hot_sizes (bags)", value)
    expected = "'dot', 'cat' or 'dcn' with model.multi_hot_sizes (bags)"
    _require(m.interaction != "attention", "model.interaction", expected, m.interaction)


def validate(cfg: RunConfig) -> RunConfig:
    """Check values that types alone do not; return `cfg`. Raises ValueError naming the key."""
    d, m, t, p = cfg.data, cfg.model, cfg.train, cfg.profiler
    _require(bool(cfg.name) and "/" not in cfg.name, "name", "a non-empty name without '/'", cfg.name)
    _require(d.batch_size > 0, "data.batch_size", "a positive integer", d.batch_size)
    _require(d.eval_batch_size > 0, "data.eval_batch_size", "a positive integer", d.eval_batch_size)
    _require(d.loader in LOADERS, "data.loader", f"one of {LOADERS}", d.loader)
    _require(d.shuffle_buffer >= 0, "data.shuffle_buffer", "an integer >= 0 (rows)", d.shuffle_buffer)
    binary_window = 'an integer >= 1 with data.loader "binary" (the rows of a window)'
    _require(
        d.loader != "binary" or d.shuffle_buffer >= 1, "data.shuffle_buffer", binary_window, d.shuffle_buffer
    )
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
    _require(m.dcn.layers > 0, "model.dcn.layers", "a positive integer", m.dcn.layers)
    _require(m.dcn.low_rank > 0, "model.dcn.low_rank", "a positive integer", m.dcn.low_rank)
    if m.interaction == "dcn":  # U V of rank >= the width is no low-rank layer: more weights than a full one
        width = 27 * m.embedding_dim  # the F + 1 vectors, concatenated
        dim = m.embedding_dim
        expected = (
            f"an integer below the cross network's width {width} (27 vectors x model.embedding_dim {dim})"
        )
        _require(m.dcn.low_rank < width, "model.dcn.low_rank", expected, m.dcn.low_rank)
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
    _check_multi_hot(cfg)
    _require(m.table_dtype in TABLE_DTYPES, "model.table_dtype", f"one of {TABLE_DTYPES}", m.table_dtype)
    if m.table_dtype == "bf16":  # only the fused updates round stochastically (dlrm.model.sparse)
        expected = "'fp32' without train.use_triton (bf16 tables need the Triton sparse kernel: --use-triton)"
        _require(t.use_triton, "model.table_dtype", expected, m.table_dtype)
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
    _require(0 <= t.adagrad_eps < math.inf, "train.adagrad_eps", "a finite number >= 0", t.adagrad_eps)
    validate_lr_schedule(t.lr_schedule)
    _require(0 <= t.weight_decay < math.inf, "train.weight_decay", "a finite number >= 0", t.weight_decay)
    _require(t.epochs > 0, "train.epochs", "a positive integer", t.epochs)
    for key, value in (
        ("train.max_steps", t.max_steps),
        ("train.eval_interval", t.eval_interval),
        ("train.evals_per_epoch", t.evals_per_epoch),
        ("train.patience", t.patience),
        ("train.checkpoint_interval", t.checkpoint_interval),
    ):
        if value is not None:
            _require(value > 0, key, "a positive integer or null", value)
    _require(t.log_interval > 0, "train.log_interval", "a positive integer", t.log_interval)
    both = t.eval_interval is not None and t.evals_per_epoch is not None
    _require(not both, "train.evals_per_epoch", "null when train.eval_interval is set", t.evals_per_epoch)
    _require(t.select_on in SELECT_ON, "train.select_on", f"one of {SELECT_ON}", t.select_on)
    _require(t.on_nonfinite in ON_NONFINITE, "train.on_nonfinite", f"one of {ON_NONFINITE}", t.on_nonfinite)
    if t.checkpoint_every_s is not None:
        ok = 0 < t.checkpoint_every_s < math.inf
        _require(ok, "train.checkpoint_every_s", "a positive number of seconds or null", t.checkpoint_every_s)
    _require(t.keep_last >= 0, "train.keep_last", "an integer >= 0", t.keep_last)
    policy, policies = t.checkpoint_policy, CHECKPOINT_POLICIES
    _require(policy in policies, "train.checkpoint_policy", f"one of {policies}", policy)
    _require(t.device in DEVICES, "train.device", f"one of {DEVICES}", t.device)
    _require(t.precision in PRECISIONS, "train.precision", f"one of {PRECISIONS}", t.precision)
    _require(t.compile_mode in COMPILE_MODES, "train.compile_mode", f"one of {COMPILE_MODES}", t.compile_mode)
    # Kernel "torch"'s sparse gradients are coalesced with a host sync: no CUDA graph can capture it. The
    # whole-step graph runs our kernels, or under --use-torch-compile alone the plain-PyTorch tables that
    # update themselves in backward (sparse kernel "torch_fused": one id a feature).
    if t.cuda_graphs:
        ok = t.use_triton or t.use_torch_compile
        expected = "true (--use-triton), or train.use_torch_compile true, with train.cuda_graphs"
        _require(ok, "train.use_triton", expected, t.use_triton)
        sizes = m.multi_hot_sizes
        ok = t.use_triton or sizes is None or all(k == 1 for k in sizes)
        expected = "one id a feature with train.cuda_graphs under --use-torch-compile (bags: --use-triton)"
        _require(ok, "model.multi_hot_sizes", expected, sizes)
        # Inductor's own CUDA graphs cannot be recorded inside the whole-step capture.
        mode = t.compile_mode
        ok = mode in ("auto", "default")
        _require(ok, "train.compile_mode", "'auto' or 'default' with train.cuda_graphs", mode)
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
    if par.data_parallel_rows is not None:
        rows = par.data_parallel_rows
        _require(rows >= 0, "parallel.data_parallel_rows", "an integer >= 0 or null", rows)
    exchange = par.exchange_dtype
    _require(exchange in EXCHANGE_DTYPES, "parallel.exchange_dtype", f"one of {EXCHANGE_DTYPES}", exchange)
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


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """`cfg` with each "KEY=VALUE" of `overrides` set in order (`--set KEY=VALUE`), then validated as a
    config file is.

    KEY is the dotted path of any config key (`train.lr`, `model.attention.heads`, `name`). VALUE is read as
    JSON (`0.05`, `true`, `null`, `[512, 256, 32]`) and else taken as a plain string (`adagrad`); a JSON
    object for a section (`model.attention={"heads": 4}`) sets the keys it names and keeps the others.

    Raises:
        ValueError: one line naming the override and the key: no "=", an unknown key, or a value that the
            key (or a key that depends on it) does not take, with what was expected.
    """
    raw = cfg.to_dict()
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item}: expected KEY=VALUE with a dotted config key, e.g. train.lr=0.05")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node, cls, parts = raw, RunConfig, key.split(".")
        for depth, part in enumerate(parts):
            known = {f.name: f.type for f in fields(cls)}
            if part not in known:
                where = ".".join(parts[:depth]) or "the config"
                raise ValueError(f"--set {item}: {key}: unknown key ({where} has {', '.join(known)})")
            if depth == len(parts) - 1:
                node[part] = _merge(node[part], value)
            elif not dataclasses.is_dataclass(known[part]):
                section = ".".join(parts[: depth + 1])
                raise ValueError(f"--set {item}: {key}: unknown key ({section} is a value, not a section)")
            else:
                node, cls = node[part], known[part]
    try:
        return from_dict(raw)
    except ValueError as err:
        # The override that the error's key names, else every override (the error names its key).
        bad = str(err).partition(":")[0]
        named = [item for item in overrides if bad.startswith(item.partition("=")[0])]
        raise ValueError(f"--set {' --set '.join(named[-1:] or overrides)}: {err}") from None


def _merge(old: Any, new: Any) -> Any:
    """`new`, or for two objects (a section) `old` with the keys of `new` set, recursively."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merge(old.get(k), v) for k, v in new.items()}}
    return new
