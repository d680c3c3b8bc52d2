"""Fused add-bias + activation in CUDA C++, forward and backward: ``y = act(x + b)``, the same op as
``kernels/bias_act.py`` (the Triton kernel), written by hand in CUDA C++ to compare with it.

Math (as kernels/bias_act.py; act and act' in ``kernels/activations.py``)
    z  = x + b                 (b broadcast over rows)
    y  = act(z)
    dx = dz = dy * act'(z)     (x's dtype)
    db = sum over rows of dz   (fp32 partial sums per block of rows, summed in fp32, returned in b's dtype)

Shapes: x [M, N], b [N], y / dy / dx [M, N]; any M >= 0, N >= 1 (inputs made contiguous). Dtypes: x and b
fp32, bf16 or fp16 (one dtype). Compute: fp32 (every value converted on load, rounded once on store).
Backward saves the inputs x and b and recomputes z, like the Triton kernel.

Kernels (``DEVICE_SOURCE``): one thread per column, a block of 256 columns by `rows` rows (>= 32; the
backward at most 256 blocks along M), the thread walking down its column (loads and stores coalesced along
the row; the bias loaded once per thread); the backward sums its column's dz in a register and writes one
fp32 partial per (row block, column), which ``kernels.gemm.partials.sum_partials`` reduces: no atomics, db the
same run to run. Where N is a multiple of 16 bytes' elements and the rows 16-byte aligned, the backward
moves 16-byte vectors instead (V columns per thread, 8 warps per block on interleaved rows, their sums
added in shared memory into the block's one row of partials). Launched on PyTorch's current stream
(passed in as a handle), so they run inside CUDA-graph capture.

Built on first use by ``torch.utils.cpp_extension.load_inline`` (ninja and nvcc; the build is cached under
torch's extensions directory, ``TORCH_EXTENSIONS_DIR``), which takes tens of seconds the first time. Without
a CUDA GPU or without nvcc the op raises ValueError with one line saying so (no CPU fallback: this is the
CUDA version by definition; ``bias_act`` is the portable one).

It equals ``act_ref(x.float() + b.float(), activation).to(x.dtype)`` (``bias_act_ref``).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from kernels.activations import ACTIVATIONS, act_ref
from kernels.bias_act import bias_act_backward, bias_act_backward_fake, bias_act_setup_context, check_inputs
from kernels.gemm.partials import sum_partials
from kernels.op import define_op

__all__ = ["bias_act_cuda", "bias_act_cuda_ref", "bias_act_cuda_fwd", "bias_act_cuda_bwd", "DEVICE_SOURCE"]

# The device code alone (no PyTorch headers): tests compile it with nvcc where nvcc is on the PATH.
DEVICE_SOURCE = r"""
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace dlrm_bias_act {

constexpr int kThreads = 256;  // columns per block

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// 1 / (1 + exp(-v)) without overflow: exp only sees -|v|.
__device__ __forceinline__ float sigmoid_f(float v) {
  const float t = expf(-fabsf(v));
  return v >= 0.f ? 1.f / (1.f + t) : t / (1.f + t);
}

// ACT: 0 identity, 1 relu, 2 sigmoid, 3 gelu_tanh, 4 silu (the order of kernels.activations.ACTIVATIONS).
template <int ACT>
__device__ __forceinline__ float act_fwd(float z) {
  if (ACT == 1) return z < 0.f ? 0.f : z;  // NaN stays NaN, as in torch.relu (fmaxf would return 0)
  if (ACT == 2) return sigmoid_f(z);
  if (ACT == 3) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    return z * sigmoid_f(2.f * u);  // 0.5 z (1 + tanh(u)) == z sigmoid(2u)
  }
  if (ACT == 4) return z * sigmoid_f(z);
  return z;
}

template <int ACT>
__device__ __forceinline__ float act_grad(float z) {
  if (ACT == 1) return z > 0.f ? 1.f : 0.f;
  if (ACT == 2) {
    const float s = sigmoid_f(z);
    return s * (1.f - s);
  }
  if (ACT == 3) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * z * z);
    const float s = sigmoid_f(2.f * u);
    return s + 2.f * z * s * (1.f - s) * du;
  }
  if (ACT == 4) {
    const float s = sigmoid_f(z);
    return s * (1.f + z * (1.f - s));
  }
  return 1.f;
}

// Block (column tile blockIdx.x, rows [blockIdx.y * rows, +rows)); one thread per column.
template <typename T, int ACT>
__global__ void bias_act_fwd_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                                    int64_t M, int64_t N, int64_t rows) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= N) return;
  const float bias = load_f(b + col);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * rows;
  const int64_t row1 = row0 + rows < M ? row0 + rows : M;
#pragma unroll 4
  for (int64_t r = row0; r < row1; ++r) {
    const int64_t i = r * N + col;  // int64: M * N can pass 2**31
    store_f(y + i, act_fwd<ACT>(load_f(x + i) + bias));
  }
}

template <typename T, int ACT>
__global__ void bias_act_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                    const T* __restrict__ b, T* __restrict__ dx,
                                    float* __restrict__ db_part, int64_t M, int64_t N, int64_t rows) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= N) return;
  const float bias = load_f(b + col);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * rows;
  const int64_t row1 = row0 + rows < M ? row0 + rows : M;
  float acc = 0.f;
#pragma unroll 4
  for (int64_t r = row0; r < row1; ++r) {
    const int64_t i = r * N + col;
    const float dz = load_f(dy + i) * act_grad<ACT>(load_f(x + i) + bias);
    store_f(dx + i, dz);
    acc += dz;
  }
  db_part[static_cast<int64_t>(blockIdx.y) * N + col] = acc;
}

// The backward with V = 16 / sizeof(T) consecutive columns per thread, each row's dy, x and dx moved as one
// 16-byte vector (when N % V == 0 and the three pointers are 16-byte aligned; else the kernel above): one
// warp spans 32 vectors of a row, the block's kVecRowWarps warps take every kVecRowWarps-th row of its rows,
// and it sums their column sums in shared memory (fixed order) into its one row of partials.
// Why: a 2-byte load per thread leaves most of the copy bandwidth unused whatever the block count; 16-byte
// vectors per thread are what the Triton kernel's loads compile to.
constexpr int kVecRowWarps = 8;

template <typename T, int ACT>
__global__ void bias_act_bwd_vec_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                        const T* __restrict__ b, T* __restrict__ dx,
                                        float* __restrict__ db_part, int64_t M, int64_t N, int64_t rows) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float sums[kVecRowWarps][32 * V];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * V;
  const bool active = col < N;
  float bias[V], acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    bias[v] = active ? load_f(b + col + v) : 0.f;
    acc[v] = 0.f;
  }
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * rows;
  const int64_t row1 = row0 + rows < M ? row0 + rows : M;
  if (active) {
#pragma unroll 2
    for (int64_t r = row0 + threadIdx.y; r < row1; r += kVecRowWarps) {
      const int64_t i = r * N + col;
      const uint4 dy_vec = *reinterpret_cast<const uint4*>(dy + i);
      const uint4 x_vec = *reinterpret_cast<const uint4*>(x + i);
      uint4 dx_vec;
      const T* dy_v = reinterpret_cast<const T*>(&dy_vec);
      const T* x_v = reinterpret_cast<const T*>(&x_vec);
      T* dx_v = reinterpret_cast<T*>(&dx_vec);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float dz = load_f(dy_v + v) * act_grad<ACT>(load_f(x_v + v) + bias[v]);
        store_f(dx_v + v, dz);
        acc[v] += dz;
      }
      *reinterpret_cast<uint4*>(dx + i) = dx_vec;
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) sums[threadIdx.y][threadIdx.x * V + v] = acc[v];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float total = 0.f;
      for (int w = 0; w < kVecRowWarps; ++w) total += sums[w][threadIdx.x * V + v];
      db_part[static_cast<int64_t>(blockIdx.y) * N + col + v] = total;
    }
  }
}

// Rows per block: at least 32, more where M would need more than `max_blocks` blocks along y: 65535 (the
// grid's limit) forward; kMaxPartialRows backward, whose partial sums (one row per block) are then short.
constexpr int64_t kMaxPartialRows = 256;
inline int64_t rows_per_block(int64_t M, int64_t max_blocks) {
  const int64_t rows = (M + max_blocks - 1) / max_blocks;
  return rows > 32 ? rows : 32;
}

inline dim3 grid_of(int64_t M, int64_t N, int64_t rows) {
  return dim3(static_cast<unsigned>((N + kThreads - 1) / kThreads),
              static_cast<unsigned>((M + rows - 1) / rows));
}

// CALL(T, ACT) for dtype code (0 fp32, 1 fp16, 2 bf16) and activation code; `ok` false if unknown.
#define DLRM_DISPATCH(dtype, act, ok, CALL)                              \
  do {                                                                   \
    ok = true;                                                           \
    if (dtype == 0) {                                                    \
      DLRM_DISPATCH_ACT(float, act, ok, CALL);                           \
    } else if (dtype == 1) {                                             \
      DLRM_DISPATCH_ACT(__half, act, ok, CALL);                          \
    } else if (dtype == 2) {                                             \
      DLRM_DISPATCH_ACT(__nv_bfloat16, act, ok, CALL);                   \
    } else {                                                             \
      ok = false;                                                        \
    }                                                                    \
  } while (0)
#define DLRM_DISPATCH_ACT(T, act, ok, CALL) \
  switch (act) {                            \
    case 0: CALL(T, 0); break;              \
    case 1: CALL(T, 1); break;              \
    case 2: CALL(T, 2); break;              \
    case 3: CALL(T, 3); break;              \
    case 4: CALL(T, 4); break;              \
    default: ok = false;                    \
  }

// Host entry points on raw pointers (the PyTorch binding passes tensors' data), on `stream`.
inline cudaError_t fwd(const void* x, const void* b, void* y, int64_t M, int64_t N, int dtype, int act,
                       cudaStream_t stream) {
  const int64_t rows = rows_per_block(M, 65535);
  const dim3 grid = grid_of(M, N, rows);
  bool ok;
#define DLRM_FWD(T, A)                                                                    \
  bias_act_fwd_kernel<T, A><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x),      \
                                                           static_cast<const T*>(b),      \
                                                           static_cast<T*>(y), M, N, rows)
  DLRM_DISPATCH(dtype, act, ok, DLRM_FWD);
#undef DLRM_FWD
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

inline cudaError_t bwd(const void* dy, const void* x, const void* b, void* dx, float* db_part, int64_t M,
                       int64_t N, int dtype, int act, cudaStream_t stream) {
  const int64_t rows = rows_per_block(M, kMaxPartialRows);
  const int64_t vec = dtype == 0 ? 4 : 8;  // elements in 16 bytes
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(x) |
                              reinterpret_cast<uintptr_t>(dx);
  bool ok;
  if (N % vec == 0 && addresses % 16 == 0) {
    const dim3 grid(static_cast<unsigned>((N / vec + 31) / 32), static_cast<unsigned>((M + rows - 1) / rows));
    const dim3 block(32, kVecRowWarps);
#define DLRM_BWD_VEC(T, A)                                                                          \
  bias_act_bwd_vec_kernel<T, A><<<grid, block, 0, stream>>>(                                        \
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(b), static_cast<T*>(dx), \
      db_part, M, N, rows)
    DLRM_DISPATCH(dtype, act, ok, DLRM_BWD_VEC);
#undef DLRM_BWD_VEC
  } else {
    const dim3 grid = grid_of(M, N, rows);
#define DLRM_BWD(T, A)                                                                              \
  bias_act_bwd_kernel<T, A><<<grid, kThreads, 0, stream>>>(                                         \
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(b), static_cast<T*>(dx), \
      db_part, M, N, rows)
    DLRM_DISPATCH(dtype, act, ok, DLRM_BWD);
#undef DLRM_BWD
  }
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace dlrm_bias_act
"""

# The PyTorch binding: tensors in, the stream handle from Python (torch.cuda.current_stream()).
_BINDING_SOURCE = r"""
#include <torch/extension.h>

// Rows per block of the backward: the partials have ceil(M / rows) rows.
int64_t bias_act_rows_per_block(int64_t M) {
  return dlrm_bias_act::rows_per_block(M, dlrm_bias_act::kMaxPartialRows);
}

void bias_act_cuda_fwd(torch::Tensor x, torch::Tensor b, torch::Tensor y, int64_t dtype, int64_t act,
                       int64_t stream) {
  const cudaError_t err = dlrm_bias_act::fwd(x.data_ptr(), b.data_ptr(), y.data_ptr(), x.size(0), x.size(1),
                                             static_cast<int>(dtype), static_cast<int>(act),
                                             reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "bias_act_cuda forward: ", cudaGetErrorString(err));
}

void bias_act_cuda_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor b, torch::Tensor dx,
                       torch::Tensor db_part, int64_t dtype, int64_t act, int64_t stream) {
  const cudaError_t err = dlrm_bias_act::bwd(dy.data_ptr(), x.data_ptr(), b.data_ptr(), dx.data_ptr(),
                                             db_part.data_ptr<float>(), x.size(0), x.size(1),
                                             static_cast<int>(dtype), static_cast<int>(act),
                                             reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "bias_act_cuda backward: ", cudaGetErrorString(err));
}
"""

_CPP_DECLARATIONS = """
int64_t bias_act_rows_per_block(int64_t M);
void bias_act_cuda_fwd(torch::Tensor x, torch::Tensor b, torch::Tensor y, int64_t dtype, int64_t act,
                       int64_t stream);
void bias_act_cuda_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor b, torch::Tensor dx,
                       torch::Tensor db_part, int64_t dtype, int64_t act, int64_t stream);
"""

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MODULE = None
_NAME = "dlrm_bias_act_cuda"
# A build takes a minute or so; a lock older than this was left by a stopped one.
STALE_LOCK_S = 600


def _remove_stale_lock() -> None:
    """torch holds `<build directory>/lock` while it builds the extension, and a process that finds the file
    waits until it is gone, without end: a build stopped midway (Ctrl-C, a time limit) leaves it, and every
    later process hangs. A lock older than STALE_LOCK_S is removed, with a warning."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(_NAME, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        message = f"bias_act_cuda: removing {lock}, left {age / 60:.0f} min ago by a build that was stopped"
        warnings.warn(message, stacklevel=3)
        lock.unlink(missing_ok=True)


def _module():
    """The compiled extension, built on first use (cached by torch across processes)."""
    global _MODULE
    if _MODULE is None:
        if not torch.cuda.is_available():
            raise ValueError("bias_act_cuda: needs a CUDA GPU (the CUDA C++ kernel has no CPU version)")
        from torch.utils.cpp_extension import CUDA_HOME, load_inline

        if CUDA_HOME is None:
            raise ValueError(
                "bias_act_cuda: needs nvcc to build the CUDA C++ kernel (set CUDA_HOME or put nvcc on PATH)"
            )
        _remove_stale_lock()
        _MODULE = load_inline(
            name=_NAME,
            cpp_sources=_CPP_DECLARATIONS,
            cuda_sources=DEVICE_SOURCE + _BINDING_SOURCE,
            functions=["bias_act_rows_per_block", "bias_act_cuda_fwd", "bias_act_cuda_bwd"],
            extra_cuda_cflags=["-O3"],
            extra_cflags=["-O3"],
        )
    return _MODULE


def _check_inputs(x: Tensor, b: Tensor, activation: str) -> None:
    """Raise ValueError naming the offending values (kernels.bias_act.check_inputs, and x on a CUDA device);
    works on fake tensors too."""
    check_inputs(x, b, activation, "bias_act_cuda")
    if x.device.type != "cuda":
        raise ValueError(f"bias_act_cuda: needs CUDA tensors (the CUDA C++ kernel), got x on {x.device}")


def bias_act_cuda_fwd(x: Tensor, b: Tensor, activation: str) -> Tensor:
    """Launch the forward kernel: y [M, N] in x's dtype. Raises ValueError for bad inputs or no GPU/nvcc."""
    _check_inputs(x, b, activation)
    module = _module()
    x, b = x.contiguous(), b.contiguous()
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream().cuda_stream
        module.bias_act_cuda_fwd(x, b, y, _DTYPE_CODES[x.dtype], ACTIVATIONS.index(activation), stream)
    return y


def bias_act_cuda_bwd(dy: Tensor, x: Tensor, b: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel and sum its partials: (dx [M, N], db [N]). Raises ValueError as the
    forward, or for a dy not shaped like x."""
    _check_inputs(x, b, activation)
    if tuple(dy.shape) != tuple(x.shape) or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(
            f"bias_act_cuda: dy must be ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
            f"({tuple(dy.shape)}, {dy.dtype}, {dy.device})"
        )
    module = _module()
    dy, x, b = dy.contiguous(), x.contiguous(), b.contiguous()
    m, n = x.shape
    dx = torch.empty_like(x)
    if m == 0:
        return dx, torch.zeros_like(b)
    rows = module.bias_act_rows_per_block(m)
    db_part = torch.empty(((m + rows - 1) // rows, n), dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream().cuda_stream
        module.bias_act_cuda_bwd(
            dy, x, b, dx, db_part, _DTYPE_CODES[x.dtype], ACTIVATIONS.index(activation), stream
        )
    return dx, sum_partials(db_part, b.dtype)


def bias_act_cuda_ref(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    """Reference ``act(x + bias)`` in plain PyTorch, fp32 math, cast back to x's dtype (``bias_act_ref``)."""
    return act_ref(x.float() + bias.float(), activation).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd glue: custom ops (torch.compile; CUDA-graph capturable); eager calls skip the dispatcher
# (kernels/op.py)
# --------------------------------------------------------------------------------------------------


def _bias_act_cuda_impl(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    return bias_act_cuda_fwd(x, bias, activation)


def _bias_act_cuda_fake(x: Tensor, bias: Tensor, activation: str) -> Tensor:
    _check_inputs(x, bias, activation)
    return x.new_empty(x.shape)


def _bias_act_cuda_backward_impl(
    dy: Tensor, x: Tensor, bias: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    return bias_act_cuda_bwd(dy, x, bias, activation)


_bias_act_cuda = define_op(
    "bias_act_cuda", _bias_act_cuda_impl, _bias_act_cuda_fake, bias_act_setup_context, bias_act_backward,
    _bias_act_cuda_backward_impl, bias_act_backward_fake,
)  # fmt: skip


def bias_act_cuda(x: Tensor, bias: Tensor, activation: str = "relu") -> Tensor:
    """Fused ``act(x + bias)`` by the CUDA C++ kernel, with a fused backward (dx and db partials in one
    kernel); ``bias_act``'s CUDA C++ twin.

    Differentiable in x and bias; works in eager, under ``torch.compile`` and in CUDA-graph capture (the
    custom op ``torch.ops.dlrm.bias_act_cuda``). Builds the extension on first use (module docstring).

    Args:
        x: [M, N] CUDA tensor, fp32, bf16 or fp16 (M >= 0, N >= 1). Non-contiguous inputs are copied.
        bias: [N] tensor, x's dtype and device.
        activation: one of ``ACTIVATIONS`` ("identity", "relu" (default), "sigmoid", "gelu_tanh", "silu").

    Returns:
        [M, N] tensor of x's dtype: ``act(x + bias)`` computed in fp32.

    Raises:
        ValueError: bad shapes, dtypes or activation, tensors not on a CUDA device, or no nvcc to build the
            kernel (one line saying so).
    """
    return _bias_act_cuda(x, bias, activation)
