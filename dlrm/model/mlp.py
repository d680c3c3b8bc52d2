"""Multi-layer perceptron used for the bottom MLP (DenseArch) and top MLP (OverArch).

Every layer is y = act(x @ W^T + b), x: [B, K] -> y: [B, N]. The parameters live in nn.Linear layers whatever
the kernel, so the same seed gives the same initial weights and checkpoints move between backends.
`kernel` picks how a layer runs:
- "torch": `F.linear(x, W, b)` then the activation (PyTorch ops; Inductor fuses them under compile);
- "bias_act": a bias-free `F.linear(x, W)` (cuBLAS) followed by our fused add-bias-activation Triton kernel
  `kernels.bias_act`, forward and backward;
- "linear_act": the whole layer, GEMM + bias + activation, in our Triton kernel `kernels.linear_act`,
  forward and backward; the layers run as one autograd node (`kernels.linear_act.linear_act_stack`);
- "cuda_bias_act": as "bias_act", with the add-bias-activation in CUDA C++ (`kernels.cuda.bias_act`, built
  on first use; CUDA only).

`block` (config `model.mlp_block`) picks what a layer is:
- "linear_act" (default): Linear then `activation` (`last_activation` after the last layer), as above;
- "ln_linear_gelu": LayerNorm (affine, eps 1e-5) -> Linear -> GELU (tanh) (parameters `norms.<i>` and
  `layers.<i>`); with a Triton kernel ("bias_act" or "linear_act") the block runs as
  `kernels.ln_linear_gelu` (a LayerNorm pass, then a GEMM with bias and GELU in its epilogue);
- "gated": one Linear of 2N outputs whose rows interleave the two halves (row 2j gives a_j, row 2j + 1
  gives b_j) and `gate` (config `model.gate`) combining them: "sigmoid_tanh" sigmoid(a) tanh(b),
  "geglu" a gelu_tanh(b), "swiglu" a silu(b); with a Triton kernel, `kernels.gated_linear` (one GEMM, the
  gate in its epilogue).
With `block_last` False (the top MLP) the last layer stays a plain Linear with `last_activation` (the logit
layer) whatever the block; the bottom MLP's last layer is a block like the others.

`lora_rank` r > 0 (config `model.lora`, block "linear_act" only) adds low-rank adapters to every layer:
act(x W^T + (alpha / r) (x A^T) B^T + b), A `lora_a.<i>` [r, K] (Kaiming-uniform, as LoRA), B `lora_b.<i>`
[N, r] (zeros: the adapted MLP starts as the plain one). With a Triton kernel the layer runs as
`kernels.lora_linear` (one GEMM, the adapter product in its epilogue; gradients for x, A and B only, so W
and b must be frozen); "torch" is the PyTorch expression.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dlrm.choices import GATES, MLP_BLOCKS, MLP_KERNELS

LN_EPS = 1e-5  # nn.LayerNorm's default

_TORCH_ACTIVATIONS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# gate(a, b) of the "gated" block in PyTorch ops (the eager reference; kernels.gated_linear.gate_ref too).
_TORCH_GATES = {
    "sigmoid_tanh": lambda a, b: torch.sigmoid(a) * torch.tanh(b),
    "geglu": lambda a, b: a * F.gelu(b, approximate="tanh"),
    "swiglu": lambda a, b: a * F.silu(b),
}


class MLP(nn.Module):
    """Stack of Linear layers with `activation` after each, and `last_activation` after the last.

    Args:
        in_features: K of the first layer.
        widths: output width N of each layer.
        activation: one of "identity", "relu", "sigmoid", "gelu_tanh", applied after all but the last layer.
        last_activation: activation after the last layer.
        kernel: "torch", "bias_act", "linear_act" or "cuda_bias_act" (see module docstring).
        block: "linear_act", "ln_linear_gelu" or "gated" (see module docstring).
        gate: for block "gated": "sigmoid_tanh", "geglu" or "swiglu".
        block_last: whether the last layer is a block too (bottom MLP) or a plain Linear with
            `last_activation` (top MLP: the logit layer). Irrelevant for block "linear_act".
    Raises:
        ValueError: unknown activation, kernel, block or gate.
    """

    def __init__(
        self,
        in_features: int,
        widths: tuple[int, ...],
        activation: str = "relu",
        last_activation: str = "relu",
        kernel: str = "torch",
        block: str = "linear_act",
        gate: str = "sigmoid_tanh",
        block_last: bool = True,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
    ):
        super().__init__()
        for act in (activation, last_activation):
            if act not in _TORCH_ACTIVATIONS:
                raise ValueError(f"unknown activation {act!r}: expected one of {tuple(_TORCH_ACTIVATIONS)}")
        if kernel not in MLP_KERNELS:
            raise ValueError(f"unknown MLP kernel {kernel!r}: expected one of {MLP_KERNELS}")
        if block not in MLP_BLOCKS:
            raise ValueError(f"unknown MLP block {block!r}: expected one of {MLP_BLOCKS}")
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}: expected one of {GATES}")
        sizes = (in_features, *widths)
        # Layers 0 .. num_blocks - 1 are `block`s; any after them are Linear + activation.
        self.num_blocks = 0 if block == "linear_act" else len(widths) - (0 if block_last else 1)
        self.layers = nn.ModuleList(
            nn.Linear(k, 2 * n if block == "gated" and i < self.num_blocks else n)
            for i, (k, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
        )
        if block == "ln_linear_gelu":
            self.norms = nn.ModuleList(nn.LayerNorm(k, eps=LN_EPS) for k in sizes[: self.num_blocks])
        self.activations = [activation] * (len(widths) - 1) + [last_activation]
        self.kernel = kernel
        self.block = block
        self.gate = gate
        for layer in self.layers:
            _init_fb_dlrm(layer)
        self.lora_rank = lora_rank
        if lora_rank:
            if block != "linear_act":
                raise ValueError(f"LoRA adapters need block 'linear_act', got {block!r}")
            self.lora_scale = (lora_alpha if lora_alpha is not None else lora_rank) / lora_rank
            self.lora_a = nn.ParameterList(nn.Parameter(torch.empty(lora_rank, k)) for k in sizes[:-1])
            self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(n, lora_rank)) for n in sizes[1:])
            for a in self.lora_a:
                nn.init.kaiming_uniform_(a, a=5**0.5)  # as LoRA (and nn.Linear) initialize A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, K] float -> [B, widths[-1]]."""
        if self.lora_rank:
            return self._lora(x)
        for i in range(self.num_blocks):
            x = self._block(i, x)
        return self._linear_act(x, self.num_blocks)

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i as an "ln_linear_gelu" or "gated" block (module docstring)."""
        layer = self.layers[i]
        if self.kernel == "torch":
            if self.block == "ln_linear_gelu":
                norm = self.norms[i]
                x = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
                return F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh")
            z = F.linear(x, layer.weight, layer.bias)
            return _TORCH_GATES[self.gate](z[:, 0::2], z[:, 1::2])
        # Kernels import here, not at module load: TRITON_INTERPRET must be decided before they are decorated.
        if self.block == "ln_linear_gelu":
            from kernels.ln_linear_gelu import ln_linear_gelu

            norm = self.norms[i]
            x, w, b = _autocast(x, layer)
            gamma, beta = (p.to(x.dtype) for p in (norm.weight, norm.bias))
            return ln_linear_gelu(x, gamma, beta, w, b, norm.eps)
        from kernels.gated_linear import gated_linear

        x, w, b = _autocast(x, layer)
        return gated_linear(x, w, b, self.gate)

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer with its adapters (module docstring)."""
        s = self.lora_scale
        layers = zip(self.layers, self.activations, self.lora_a, self.lora_b, strict=True)
        if self.kernel == "torch":
            for layer, act, a, b in layers:
                z = F.linear(x, layer.weight, layer.bias) + s * F.linear(F.linear(x, a), b)
                x = _TORCH_ACTIVATIONS[act](z)
            return x
        from kernels.lora_linear import lora_linear

        for layer, act, a, b in layers:
            x, w, bias = _autocast(x, layer)
            x = lora_linear(x, w, bias, a.to(x.dtype), b.to(x.dtype), s, act)
        return x

    def _linear_act(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Layers start.. as Linear + activation, on `kernel`."""
        pairs = list(zip(self.layers, self.activations, strict=True))[start:]
        if not pairs:  # every layer was a block (the bottom MLP's)
            return x
        # Kernels import here, not at module load: TRITON_INTERPRET must be decided before they are decorated.
        if self.kernel == "linear_act":
            from kernels.linear_act import linear_act_stack

            weights = [layer.weight for layer, _ in pairs]
            biases = [layer.bias for layer, _ in pairs]
            if torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)
                x = x.to(dtype)
                cast = _cast_together(dtype, weights + biases)
                weights, biases = cast[: len(pairs)], cast[len(pairs) :]
            # One autograd node for the layers: launched from Python, each node's glue is host time.
            return linear_act_stack(x, weights, biases, [act for _, act in pairs])
        if self.kernel in ("bias_act", "cuda_bias_act"):
            if self.kernel == "bias_act":
                from kernels.bias_act import bias_act
            else:
                from kernels.cuda.bias_act import bias_act_cuda as bias_act

            for layer, act in pairs:
                x, w, b = _autocast(x, layer)
                x = bias_act(F.linear(x, w), b, act)
            return x
        for layer, act in pairs:
            x = _TORCH_ACTIVATIONS[act](F.linear(x, layer.weight, layer.bias))
        return x


def _autocast(x: torch.Tensor, layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, W, b) in autocast's dtype when autocast is on, as F.linear gets them; else unchanged. Autocast
    does not cast the inputs of our custom ops by itself. The casts' backward returns fp32 gradients to
    the fp32 master weights."""
    if not torch.is_autocast_enabled(x.device.type):
        return x, layer.weight, layer.bias
    dtype = torch.get_autocast_dtype(x.device.type)
    return x.to(dtype), layer.weight.to(dtype), layer.bias.to(dtype)


def _cast_together(dtype: torch.dtype, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` (one dtype, e.g. a stack's fp32 weights and biases) in `dtype`, as `t.to(dtype)` each
    would give them, with their gradients back in the tensors' dtype: one launch each way (`_cast`) where a
    cast a tensor launches 2L small kernels each way."""
    if all(t.dtype == dtype for t in tensors):
        return tensors
    return list(_CastTogether.apply(dtype, *tensors))


def _cast(tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Contiguous `tensors`, each in its dtype of `dtypes`, as new tensors: kernels.multi_tensor's one
    launch where our Triton kernels run, for up to its MAX_TENSORS tensors of one dtype to one dtype,
    outside torch.compile's tracing (which takes the plain op); else one torch._foreach_copy_ (a
    multi-tensor kernel with a block per 65,536 elements: too few blocks for an MLP stack's parameters,
    kernels/multi_tensor.py says why)."""
    # Kernels import here, not at module load: TRITON_INTERPRET must be decided before they are decorated.
    from kernels.launch import use_triton
    from kernels.multi_tensor import MAX_TENSORS, cast_together

    one_dtype = len({t.dtype for t in tensors}) == 1 and len(set(dtypes)) == 1
    if (
        one_dtype
        and len(tensors) <= MAX_TENSORS
        and use_triton(tensors[0])
        and not torch.compiler.is_compiling()
    ):
        return cast_together(tensors, dtypes[0])
    out = [torch.empty_like(t, dtype=dtype) for t, dtype in zip(tensors, dtypes, strict=True)]
    torch._foreach_copy_(out, tensors)
    return out


class _CastTogether(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = [t.dtype for t in tensors]
        return tuple(_cast([t.contiguous() for t in tensors], [dtype] * len(tensors)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *_cast([g.contiguous() for g in grads], ctx.dtypes))


def _init_fb_dlrm(layer: nn.Linear) -> None:
    """FB-DLRM's initialization: W ~ N(0, sqrt(2 / (K + N))), b ~ N(0, sqrt(1 / N)) (dlrm_s_pytorch.py)."""
    n, k = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, (2.0 / (k + n)) ** 0.5)
        layer.bias.normal_(0.0, (1.0 / n) ** 0.5)
