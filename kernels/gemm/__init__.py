"""The GEMM pieces our fused ops share: tiles (``tiles``), autotuning and dot precision (``tuning``), operand
layouts (``layout``) and checks (``checks``), the backward's dz pass and cuBLAS dx/dW (``grads``), the Triton
dW GEMM with dz in registers and the choice between the two (``dw``), the dx GEMM that applies the layer
below's act' (``dx_act``), and the sum of per-program partials (``partials``)."""
