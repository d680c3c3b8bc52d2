"""How our Triton GEMM kernels (linear_act's forward and dW) are tuned and what precision their dots use.

Autotuning over a few Hopper tile shapes, keyed on (M bucket, N, K) and the dots' ``INPUT_PRECISION``: N
and K are a layer's widths and the M bucket a power of two of the batch (``m_bucket``), so a new batch size
in the same bucket reuses the tuned config; Triton adds the tensors' dtypes to the key itself; fp32 dots as
one TF32 product and as three (``input_precision``) are tuned apart, so a process that runs both precisions
uses each one's own best config. A kernel names its tile dims (rows, cols | reduction), e.g. the forward
(BLOCK_M, BLOCK_N | BLOCK_K) and dW (BLOCK_N, BLOCK_K | BLOCK_M), and takes an ``M_BUCKET`` argument that
only feeds the key. In the interpreter: one fixed small config.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
from triton import __version__ as TRITON_VERSION
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.launch import INTERPRETED, capture, own_stream

__all__ = [
    "ChoiceTable",
    "TunedKernel",
    "autotuned",
    "chosen",
    "even_k",
    "fastest",
    "graph_time",
    "input_precision",
    "m_bucket",
    "use_chosen",
]

_KEY = ["M_BUCKET", "N", "K"]  # passed by position
_PRECISION = "INPUT_PRECISION"  # passed by keyword, a constexpr of every GEMM kernel
_M_BUCKET_MIN, _M_BUCKET_MAX = 64, 65536

# Hopper configs: (tile rows, tile cols, num_warps, num_stages) plus a reduction chunk.
# 16-bit operands use a 64-deep reduction chunk, fp32 a 32-deep one (same bytes per stage in shared memory:
# 128x256 tiles with 3 stages need ~144 KiB either way, under Hopper's 227 KiB); _pruner keeps the set of the
# operand's element size. 128x128 with 3 stages (96 KiB) fits two CTAs per SM, so one CTA's epilogue runs
# under the other's main loop, which pays off for epilogues with an activation (GELU) on wide layers. The
# autotuner keeps it where it wins.
_GPU_SHAPES = [
    (128, 256, 8, 3),
    (256, 128, 8, 3),
    (128, 128, 4, 4),
    (128, 128, 4, 3),
    (128, 64, 4, 4),
    (64, 128, 4, 4),
    (64, 64, 4, 4),
]
_RED_BY_ELEMENT_SIZE = {2: 64, 4: 32}
# The interpreter pays a fixed cost per program and takes one config: 32-wide tiles, so the tests' small
# shapes still span several tiles (and partial ones) in every dimension.
_INTERPRETER_SHAPE = (32, 32, 32, 4, 1)


class ChoiceTable(dict):
    """The choices of one kind made by timing, by key (a tuple of sizes, dtypes and flags), registered under
    a process-wide unique `name` so that ``chosen`` lists it and ``use_chosen`` can fill it."""

    def __init__(self, name: str):
        super().__init__()
        if name in _TABLES:
            raise ValueError(f"a choice table named {name!r} exists already")
        self.name = name
        _TABLES[name] = self

    def preset(self, key):
        """The choice `use_chosen` gave for `key` (matched by its repr), or None."""
        return _PRESET.get(self.name, {}).get(repr(key))


_TABLES: dict[str, ChoiceTable] = {}
_PRESET: dict[str, dict] = {}  # use_chosen's choices: table name -> repr(key) -> choice


def _machine() -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "triton": TRITON_VERSION, "interpreted": INTERPRETED}


def chosen() -> dict:
    """This process's choices: {"device", "triton", "interpreted", "choices": {table name: {repr(key):
    choice}}}, JSON-able (a choice is a name or a dict of launch options)."""
    tables = {name: {repr(k): v for k, v in table.items()} for name, table in _TABLES.items() if table}
    return {**_machine(), "choices": tables}


def use_chosen(record: dict) -> bool:
    """Take `record` (a ``chosen()`` of another process) for every key not yet chosen here: a launch whose
    key it holds uses its choice and times nothing. False, taking nothing, where the record is of another
    GPU model, Triton version or interpreter setting (its timings do not carry over, nor might its launch
    options)."""
    if {k: record.get(k) for k in _machine()} != _machine():
        return False
    _PRESET.clear()
    _PRESET.update(record.get("choices", {}))
    return True


def m_bucket(m: int) -> int:
    """next_power_of_2(M) clamped to [64, 65536]: the M part of the autotuning key."""
    return min(max(triton.next_power_of_2(m), _M_BUCKET_MIN), _M_BUCKET_MAX)


def even_k(k: int) -> bool:
    """Whether K is a multiple of every config's reduction chunk (BLOCK_K: 32 or 64; 32 in the interpreter),
    so a GEMM kernel's K loop loads whole chunks with no mask along K (its EVEN_K)."""
    return k % max(_RED_BY_ELEMENT_SIZE.values()) == 0


def input_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies fp32 operands, on tensor cores either way, at the precision PyTorch's own
    matmuls have (``torch.backends.cuda.matmul.allow_tf32``), so every backend computes the same GEMM
    precision: "tf32" (one TF32 product: operands rounded to 10 mantissa bits) where TF32 is allowed,
    else "tf32x3" (each operand split into a TF32 high part and a TF32 low part, three products summed
    in fp32: about fp32's accuracy, on tensor cores rather than the FMA units). bf16/fp16 operands: "tf32"
    (ignored for them). In the interpreter, which computes plain fp32 dots whatever it is given: "ieee".
    """
    if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee" if INTERPRETED else "tf32x3"


# A block dim of a TMA descriptor: a tile constexpr's name, or (name, divisor) for a part of that tile dim,
# e.g. ("BLOCK_N", 4) for a quarter of the tile's columns.
BlockDim = str | tuple[str, int]


def _block_shape(dims: tuple[BlockDim, ...], values: dict) -> list[int]:
    """The block shape that `dims` name, from a config's tile constexprs `values`."""
    return [values[d] if isinstance(d, str) else values[d[0]] // d[1] for d in dims]


def _set_block_shapes(descriptors: dict[str, tuple[BlockDim, ...]], args: dict) -> None:
    """Set each TMA descriptor argument's block shape to the config's tile dims, e.g. x_desc to [BLOCK_M,
    BLOCK_K]: a descriptor's block shape is part of the kernel's signature and must match the tile it
    loads."""
    for name, dims in descriptors.items():
        args[name].block_shape = _block_shape(dims, args)


def _configs(names: tuple[str, str, str], extra: dict, descriptors: dict) -> list[triton.Config]:
    hook = partial(_set_block_shapes, descriptors) if descriptors else None
    if INTERPRETED:
        a, b, r, warps, stages = _INTERPRETER_SHAPE
        config = {names[0]: a, names[1]: b, names[2]: r, **extra}
        return [triton.Config(config, num_warps=warps, num_stages=1, pre_hook=hook)]
    return [
        triton.Config(
            {names[0]: a, names[1]: b, names[2]: r, **extra},
            num_warps=warps,
            num_stages=stages,
            pre_hook=hook,
        )
        for r in _RED_BY_ELEMENT_SIZE.values()
        for a, b, warps, stages in _GPU_SHAPES
    ]


def _pruner(names: tuple[str, str, str], dims: tuple[str, str], operand: str):
    """Keep the configs of the operand's element size whose tiles are not far larger than the problem.

    A tile dim of 64 always stays, so every problem keeps at least the (64, 64) config.
    """

    def prune(configs, named_args, **kwargs):
        elsize = _tensor(named_args[operand]).element_size()
        limits = [max(64, triton.next_power_of_2(int(named_args[d]))) for d in dims]
        kept = [
            c
            for c in configs
            if c.kwargs[names[2]] == _RED_BY_ELEMENT_SIZE[elsize]
            and c.kwargs[names[0]] <= limits[0]
            and c.kwargs[names[1]] <= limits[1]
        ]
        return kept or configs[-1:]

    return prune


def _tensor(arg) -> torch.Tensor:
    """A kernel's tensor argument, or the tensor a TMA descriptor argument describes."""
    return arg.base if isinstance(arg, TensorDescriptor) else arg


def _quick_bench(kernel_call, quantiles):
    """Shorter than Triton's default (25 ms warm-up, 100 ms measured) per config: ample for these kernels."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


class TunedKernel:
    """A ``triton.autotune``'d kernel whose launches skip the autotuner once their key has been tuned.

    The autotuner finds a launch's config by building dicts of every argument and their dtypes, per call:
    host time that launches from Python pay, several times a plain Triton launch's. This keeps each key's
    tuned launch options, keyed as the autotuner keys our kernels: (M_BUCKET, N, K), the operand's dtype
    (the kernels' other tensors share it, or have a dtype of their own that never changes) and
    INPUT_PRECISION, and launches the jitted kernel with them directly, setting its TMA descriptors' block
    shapes to the tuned tiles as the configs' pre-hook does while tuning. Used as
    ``kernel[grid](*args, **constexprs)``, with M_BUCKET, N, K, the operand and the descriptors passed by
    position and INPUT_PRECISION by keyword.

    Attributes:
        fn: the ``@triton.jit`` kernel.
        autotuner: the ``triton.autotune`` wrapper, which tunes each new key.
    """

    def __init__(self, autotuner, operand: str, descriptors: dict[str, tuple[BlockDim, ...]]):
        self.autotuner = autotuner
        self.fn = autotuner.fn
        names = autotuner.arg_names
        self._key_positions = tuple(names.index(k) for k in _KEY)
        self._operand_position = names.index(operand)
        self._descriptors = [(names.index(name), dims) for name, dims in descriptors.items()]
        self._options = ChoiceTable(self.fn.__name__)
        # The launch options a config sets: a record of another version of the kernel (a resumed run's), with
        # a constexpr more or fewer, is timed anew rather than launched.
        self._options_names = set(autotuner.configs[0].all_kwargs())

    def __getitem__(self, grid):
        return partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs) -> None:
        m_bucket_, n, k = (args[i] for i in self._key_positions)
        key = (m_bucket_, n, k, _tensor(args[self._operand_position]).dtype, kwargs.get(_PRECISION))
        options = self._options.get(key)
        if options is None:
            options = self._options.preset(key)
            if options is not None and options.keys() == self._options_names:
                self._options[key] = options
            else:
                options = None
        if options is None:
            self.autotuner[grid](*args, **kwargs)
            self._options[key] = self.autotuner.best_config.all_kwargs()
            return
        for position, dims in self._descriptors:
            args[position].block_shape = _block_shape(dims, options)
        self.fn.run(*args, grid=grid, warmup=False, **kwargs, **options)


def autotuned(
    kernel,
    operand: str,
    extra: dict | None = None,
    descriptors: dict[str, tuple[BlockDim, ...]] | None = None,
    names: tuple[str, str, str] = ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    dims: tuple[str, str] = ("M_BUCKET", "N"),
):
    """``triton.autotune`` of `kernel` over the Hopper configs, as a ``TunedKernel``; one fixed config in
    the interpreter (no benchmarking).

    Args:
        kernel: a ``@triton.jit`` GEMM kernel taking ``M_BUCKET``, ``N`` and ``K``.
        operand: the tensor argument (or TMA descriptor) of the operands' dtype, whose element size picks
            the reduction chunk and whose dtype is part of the key, e.g. "x_ptr".
        extra: further constexprs every config sets, e.g. {"GROUP": 8}; None: none.
        descriptors: the TMA descriptor arguments (``kernels.gemm.layout.tma_descriptor``) and the tile
            dims of their block shapes (``BlockDim``), e.g. {"x_desc": ("BLOCK_M", "BLOCK_K")}; None: none.
        names: its tile constexprs (rows, cols, reduction chunk); by default those of an [M, N] output
            tile over a K reduction.
        dims: the size arguments that bound the tile rows and cols, for pruning; by default the M bucket
            and N.
    """
    descriptors = descriptors or {}
    configs = _configs(names, extra or {}, descriptors)
    if INTERPRETED:
        return TunedKernel(
            triton.autotune(configs=configs, key=[*_KEY, _PRECISION])(kernel), operand, descriptors
        )
    autotuner = triton.autotune(
        configs=configs,
        key=[*_KEY, _PRECISION],
        prune_configs_by={"early_config_prune": _pruner(names, dims, operand)},
        do_bench=_quick_bench,
    )(kernel)
    return TunedKernel(autotuner, operand, descriptors)


def graph_time(fn) -> float:
    """Median ms of `fn()` replayed as a CUDA graph: the GPU time a graph-captured step pays, to choose
    between implementations. Timed as launched from Python instead, host overhead would decide the choice
    for small layers, differently run to run. Captured on a stream of its own (``kernels.launch.own_stream``):
    a timing graph is destroyed mid-run (a new shape seen by the evaluation), and on the training step's or
    the evaluation's capture stream it would pull their graphs' cuBLAS workspace from under them."""
    from triton.testing import do_bench

    fn()  # autotuning and lazy initialization, outside the capture
    graph = torch.cuda.CUDAGraph()
    with capture(graph, own_stream(torch.cuda.current_device(), "timing")):
        fn()
    ms = do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms


def fastest(choices: ChoiceTable, key, candidates: dict) -> str:
    """The name of the fastest of `candidates` (name -> a call without arguments) for `key`: each timed once
    (``graph_time``) the first time the key is seen, the winner remembered in `choices`; a key whose choice
    ``use_chosen`` gave takes it untimed. Inside a CUDA graph capture, where nothing can be timed, an unseen
    key takes the first candidate (not remembered)."""
    if key not in choices and (preset := choices.preset(key)) in candidates:
        choices[key] = preset
    if key not in choices:
        if torch.cuda.is_current_stream_capturing():
            return next(iter(candidates))
        times = {name: graph_time(fn) for name, fn in candidates.items()}
        choices[key] = min(times, key=times.get)
    return choices[key]
