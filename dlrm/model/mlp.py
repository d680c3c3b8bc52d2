"""Multi-layer perceptron used for the bottom MLP (DenseArch) and top MLP (OverArch).

Every layer is y = act(x @ W^T + b), x: [B, K] -> y: [B, N]. The parameters live in nn.Linear layers whatever
the kernel, so the same seed gives the same initial weights and checkpoints move between backends.
`kernel` picks how a layer runs:
- "torch": `F.linear(x, W, b)` then the activation (PyTorch ops; Inductor fuses them under compile);
- "bias_act": a bias-free `F.linear(x, W)` (cuBLAS) followed by our fused add-bias-activation Triton kernel
  `kernels.bias_act`, forward and backward;
- "linear_act": the whole layer, GEMM + bias + activation, in our Triton kernel `kernels.linear_act`,
  forward and backward.
"""

import torch
import torch.nn.functional as F
from torch import nn

MLP_KERNELS = ("torch", "bias_act", "linear_act")

_TORCH_ACTIVATIONS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """Stack of Linear layers with `activation` after each, and `last_activation` after the last.

    Args:
        in_features: K of the first layer.
        widths: output width N of each layer.
        activation: one of "identity", "relu", "sigmoid", "gelu_tanh", applied after all but the last layer.
        last_activation: activation after the last layer.
        kernel: "torch", "bias_act" or "linear_act" (see module docstring).
    Raises:
        ValueError: unknown activation or kernel.
    """

    def __init__(
        self,
        in_features: int,
        widths: tuple[int, ...],
        activation: str = "relu",
        last_activation: str = "relu",
        kernel: str = "torch",
    ):
        super().__init__()
        for act in (activation, last_activation):
            if act not in _TORCH_ACTIVATIONS:
                raise ValueError(f"unknown activation {act!r}: expected one of {tuple(_TORCH_ACTIVATIONS)}")
        if kernel not in MLP_KERNELS:
            raise ValueError(f"unknown MLP kernel {kernel!r}: expected one of {MLP_KERNELS}")
        sizes = (in_features, *widths)
        self.layers = nn.ModuleList(nn.Linear(k, n) for k, n in zip(sizes[:-1], sizes[1:], strict=True))
        self.activations = [activation] * (len(widths) - 1) + [last_activation]
        self.kernel = kernel
        for layer in self.layers:
            _init_fb_dlrm(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, K] float -> [B, widths[-1]]."""
        # Kernels import here, not at module load: TRITON_INTERPRET must be decided before they are decorated.
        if self.kernel == "linear_act":
            from kernels.linear_act import linear_act

            for layer, act in zip(self.layers, self.activations, strict=True):
                x, w, b = _autocast(x, layer)
                x = linear_act(x, w, b, act)
            return x
        if self.kernel == "bias_act":
            from kernels.bias_act import bias_act

            for layer, act in zip(self.layers, self.activations, strict=True):
                x, w, b = _autocast(x, layer)
                x = bias_act(F.linear(x, w), b, act)
            return x
        for layer, act in zip(self.layers, self.activations, strict=True):
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


def _init_fb_dlrm(layer: nn.Linear) -> None:
    """FB-DLRM's initialization: W ~ N(0, sqrt(2 / (K + N))), b ~ N(0, sqrt(1 / N)) (dlrm_s_pytorch.py)."""
    n, k = layer.weight.shape
    with torch.no_grad():
        layer.weight.normal_(0.0, (2.0 / (k + n)) ** 0.5)
        layer.bias.normal_(0.0, (1.0 / n) ** 0.5)
