"""DCNv2's low-rank cross network (Wang et al. 2021, "DCN V2: Improved Deep & Cross Network and Practical
Lessons for Web-scale Learning to Rank Systems", eq. 1 with W_l = U_l V_l), the "dcn" interaction of the
MLPerf DLRM-DCNv2 model.

Over x0 [B, N] (N = (F + 1) D: the bottom MLP's output, then the F pooled embeddings, flattened, as TorchRec's
InteractionDCNArch concatenates them), `layers` layers of

    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l        (* elementwise)

with V_l [r, N] (no bias), U_l [N, r] and b_l [N]; the output x_L [B, N] goes to the top MLP. Parameters as
TorchRec's LowRankCrossNet: V_l and U_l Xavier-normal, b_l zeros (held in nn.Linear layers: `v.<l>.weight`
[r, N], `u.<l>.weight` [N, r], `u.<l>.bias` [N]).

`kernel` "torch" runs each layer as PyTorch ops (Inductor fuses the elementwise tail under compile);
"triton" runs the whole network as one op, `kernels.cross_net`: each layer our fused cross layer
(`kernels.cross`: the second GEMM with x0 * (z + b) + x_l in its epilogue, forward and backward), and x0's
gradient summed over the layers inside the backward kernels rather than by autograd's adds.
"""

import torch
from torch import nn
from torch.profiler import record_function

from dlrm.config import DcnConfig

KERNELS = ("torch", "triton")


class LowRankCrossNet(nn.Module):
    """The low-rank cross network (module docstring): [B, N] -> [B, N], the input's dtype (under autocast:
    the autocast dtype, for both kernels).

    Args:
        in_features: N, the width of x0.
        cfg: `layers` (L >= 1) and `low_rank` (r >= 1).
        kernel: "torch" or "triton".
    Raises:
        ValueError: an unknown kernel, or layers or low_rank below 1.
    """

    def __init__(self, in_features: int, cfg: DcnConfig, kernel: str = "torch"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown cross-network kernel {kernel!r}: expected one of {KERNELS}")
        if cfg.layers < 1 or cfg.low_rank < 1:
            raise ValueError(f"LowRankCrossNet: need layers >= 1 and low_rank >= 1, got {cfg}")
        self.kernel = kernel
        r = cfg.low_rank
        self.v = nn.ModuleList(nn.Linear(in_features, r, bias=False) for _ in range(cfg.layers))
        self.u = nn.ModuleList(nn.Linear(r, in_features) for _ in range(cfg.layers))
        for v, u in zip(self.v, self.u, strict=True):  # TorchRec's LowRankCrossNet initialization
            nn.init.xavier_normal_(v.weight)
            nn.init.xavier_normal_(u.weight)
            nn.init.zeros_(u.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        device = x0.device.type
        if torch.is_autocast_enabled(device):  # one dtype for every term, as the fused kernel takes them
            x0 = x0.to(torch.get_autocast_dtype(device))
        if self.kernel == "triton":
            from kernels.cross_net import cross_net

            with record_function("cross_net"):  # the profiler's part (scripts/breakdown_step.py)
                layers = ([v.weight for v in self.v], [u.weight for u in self.u], [u.bias for u in self.u])
                return cross_net(x0, *(torch.stack(ws).to(x0.dtype) for ws in layers))
        x = x0
        for layer, (v, u) in enumerate(zip(self.v, self.u, strict=True)):
            with record_function(f"cross_layer_{layer}"):  # the profiler's parts (scripts/breakdown_step.py)
                x = x0 * u(v(x)) + x
        return x
