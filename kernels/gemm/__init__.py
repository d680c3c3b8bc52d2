"""The GEMM pieces our fused ops share: tiles (``tiles``), autotuning and dot precision (``tuning``),
operand layouts (``layout``), the backward's dz pass and cuBLAS dx/dW (``grads``), the Triton dW GEMM with dz
in registers (``dw``) and the sum of per-program partials (``partials``)."""
