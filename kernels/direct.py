"""Eager calls of our custom ops without the dispatcher.

Each op is a ``torch.library.custom_op`` (forward and backward ops, ``register_fake``, ``register_autograd``)
so that torch.compile and torch.export see an opaque op with a shape function. Called eagerly, that path
costs host time the kernels do not: the dispatcher, the op's Python wrapper with its aliasing checks, and
the autograd glue built around it, in the forward and again in the backward. Launched from Python without
a CUDA graph, that host time is the step's time; calling the same Python bodies directly skips the
dispatcher and the wrapper (what remains is mostly the backward's Python body on autograd's device
thread; `scripts/bench_launch_host.py` measures it).

So an op's public function calls ``call(op, eager_fn, ...)``: the custom op while torch.compile or
torch.export traces, else ``eager_fn``, an autograd.Function (``eager_function``) running the same Python
body and the same autograd formulas that the op registers. Both paths launch the same kernels.
"""

from collections.abc import Callable

import torch
from torch.compiler import is_compiling


def call(op: Callable, eager_fn: Callable, *args):
    """``op(*args)`` while torch.compile or torch.export traces (they need the custom op and its fake),
    else ``eager_fn(*args)``."""
    if is_compiling():
        return op(*args)
    return eager_fn(*args)


def eager_function(name: str, impl: Callable, setup_context: Callable, backward: Callable) -> Callable:
    """The ``apply`` of an autograd.Function named `name` whose forward is ``impl(*inputs)`` followed by
    ``setup_context(ctx, inputs, output)`` and whose backward is ``backward(ctx, *grads)``: the custom op's
    Python body and the two functions its ``register_autograd`` took. Gradients of outputs nothing used
    reach `backward` as None (as through the op), not as tensors of zeros."""

    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods).apply
