"""One definition per op: its torch.library custom ops, their fakes, its autograd formulas and its eager path.

Each op is a ``torch.library.custom_op`` (a forward op and a backward op, each with ``register_fake``, and
``register_autograd``) so that torch.compile and torch.export see an opaque op with a shape function.
Called eagerly, that path costs host time the kernels do not: the dispatcher, the op's Python wrapper with
its aliasing checks, and the autograd glue built around it, in the forward and again in the backward.
Launched from Python without a CUDA graph, that host time is the step's time; calling the same Python
bodies directly skips the dispatcher and the wrapper (what remains is mostly the backward's Python body on
autograd's device thread; `scripts/bench_launch_host.py` measures it).

So ``define_op`` takes an op's pieces once (forward and backward bodies, whose annotations give the ops'
schemas, their fakes, ``setup_context`` and the gradient formulas) and returns an ``Op``: called, it runs
the custom op while torch.compile or torch.export traces, else an autograd.Function running the same
bodies and the same formulas. Both paths launch the same kernels.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps

import torch
from torch import Tensor
from torch.compiler import is_compiling

__all__ = ["Op", "define_op"]


@dataclass(frozen=True)
class Op:
    """An op defined by ``define_op``.

    Attributes:
        op: the forward custom op ``torch.ops.dlrm.<name>``, differentiable through its backward op.
        eager: the eager path, an autograd.Function's ``apply`` (or the op's own eager function); same
            arguments and outputs as ``op``, except that an output the body leaves out is None there.
    """

    op: Callable
    eager: Callable

    def __call__(self, *args):
        """``op(*args)`` while torch.compile or torch.export traces (they need the custom op and its
        fake), else ``eager(*args)``."""
        if is_compiling():
            return self.op(*args)
        return self.eager(*args)


def _eager_function(name: str, impl: Callable, setup_context: Callable, backward: Callable) -> Callable:
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


def _no_optional_tensors(annotation):
    """A return annotation with ``Tensor | None`` as ``Tensor`` (custom-op outputs are tensors) and the
    type of None as None (what the schema inference takes for no output)."""
    if annotation is type(None):
        return None
    if annotation == Tensor | None:
        return Tensor
    if typing.get_origin(annotation) is tuple:
        return tuple[tuple(_no_optional_tensors(a) for a in typing.get_args(annotation))]
    return annotation


def _custom_op(name: str, body: Callable, mutates_args: tuple[str, ...]):
    """``body`` as the custom op ``dlrm::<name>``, each None it returns in a tuple replaced by a distinct
    empty [0] tensor (custom-op outputs alias nothing); the schema comes from body's annotations."""
    hints = typing.get_type_hints(body)
    params = [p.replace(annotation=hints[p.name]) for p in inspect.signature(body).parameters.values()]
    # The first tensor argument, whose dtype and device the empty tensors take.
    like_at, like = next((i, p.name) for i, p in enumerate(params) if "Tensor" in str(p.annotation))

    @wraps(body)
    def impl(*args, **kwargs):
        out = body(*args, **kwargs)
        if not isinstance(out, tuple):
            return out
        empty = (args[like_at] if like_at < len(args) else kwargs[like]).new_empty
        return tuple(empty((0,)) if t is None else t for t in out)

    impl.__signature__ = inspect.Signature(params, return_annotation=_no_optional_tensors(hints["return"]))
    del impl.__wrapped__  # the signature is impl's own, not body's
    return torch.library.custom_op(f"dlrm::{name}", impl, mutates_args=mutates_args)


def define_op(
    name: str,
    forward: Callable,
    forward_fake: Callable,
    setup_context: Callable,
    gradients: Callable,
    backward: Callable | None = None,
    backward_fake: Callable | None = None,
    backward_name: str | None = None,
    backward_mutates: tuple[str, ...] = (),
    eager: Callable | None = None,
) -> Op:
    """Register the custom ops of one op (module docstring) and return it as an ``Op``.

    Args:
        name: the forward op's name: ``torch.ops.dlrm.<name>``.
        forward: the forward's body, with annotations (they give the op's schema); it may return None in
            place of a tensor of its output tuple, which the op returns as an empty [0] tensor.
        forward_fake: the forward's shape function, with the op's outputs (empty [0] tensors where the
            body may return None).
        setup_context: ``(ctx, inputs, output)``, as ``register_autograd`` takes it; `output` is the op's
            (empty tensors) or the body's (None).
        gradients: ``(backward_fn, ctx, *output_grads) -> input grads``, where ``backward_fn`` is the
            backward op under the custom op and the backward body on the eager path; ``(ctx,
            *output_grads)`` for an op without a backward op.
        backward: the backward's body, with annotations, or None where `gradients` needs no backward op.
        backward_fake: the backward op's shape function.
        backward_name: the backward op's name (default ``<name>_backward``).
        backward_mutates: the backward body's arguments that it writes in place.
        eager: the eager path, where it is not the autograd.Function of the bodies above; it takes the
            op's arguments and gives the op's outputs (None for the body's None).
    """
    op = _custom_op(name, forward, ())
    op.register_fake(forward_fake)
    if backward is None:
        op.register_autograd(gradients, setup_context=setup_context)
    else:
        backward_op = _custom_op(backward_name or f"{name}_backward", backward, backward_mutates)
        backward_op.register_fake(backward_fake)
        op.register_autograd(partial(gradients, backward_op), setup_context=setup_context)
    if eager is None:
        camel = "".join(part.title() for part in name.split("_"))
        eager_gradients = gradients if backward is None else partial(gradients, backward)
        eager = _eager_function(camel, forward, setup_context, eager_gradients)
    return Op(op, eager)
