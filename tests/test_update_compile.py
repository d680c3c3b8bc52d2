"""kernels/embedding_update.py's kernels compiled for sm_90 without a GPU, in a process of its own (the
tests' interpreter runs a kernel as Python, where, say, a function returning int32 offsets on one branch
and int64 on another passes; a compile refuses it). Each kernel with the index dtypes
`launch_update` hands it: segments int32 (int64 past 2**31 lookups, and at the levels after the first),
the pooled gradient's rows int32, the lookups' order int64, the sorted keys int32; the SGD kernel's
rows int32 (a bag lookup's, where they fit) and int64."""

import os
import subprocess
import sys

from tests.conftest import REPO


def compile_for_sm90(name: str, types: dict[str, str], constexprs: dict, warps: int) -> None:
    """Compile kernels.embedding_update's kernel `name` for sm_90, its arguments typed by `types` (by name;
    other pointers int64, other scalars int32) and `constexprs`. Raises triton's CompilationError."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.embedding_update as update

    fn = getattr(update, name)
    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "*i64" if arg.endswith("_ptr") else "i32")
        for arg in fn.arg_names
    }
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_all() -> None:
    """Compile every kernel of the sorted path in each variant `launch_update` launches; print one line a
    compile (the kernel, its index dtypes and switches)."""
    import kernels.embedding_update as update

    grad = {"grad_ptr": "*bf16", "scales_ptr": "*fp32"}
    for segment in ("*i32", "*i64"):
        # Pooled bags with and without scales (mean / sum pooling), one-hot lookups.
        for pooled, scaled, rows in ((True, True, "*i32"), (True, False, "*i32"), (False, False, "*i64")):
            sums = {"partial_ptr": "*fp32", "sums_ptr": "*fp32"}
            types = {"rows_ptr": rows, "segment_ptr": segment, **sums, **grad}
            switches = {
                "POOLED": pooled, "SCALED": scaled, "OFFSET32": True, "SHORT": update.SHORT_SEGMENT,
                "CHUNK": update.CROSSING_CHUNK, "BLOCK_N": update.SUM_BLOCK_N, "BLOCK_D": 128,
            }  # fmt: skip
            compile_for_sm90("_crossing_sums_kernel", types, switches, 1)
            print("_crossing_sums_kernel", segment, rows, pooled, scaled)
            for optimizer in update.OPTIMIZERS:
                types = {
                    "segment_ptr": segment, "sorted_ptr": "*i32", "rows_ptr": rows, "sums_ptr": "*fp32",
                    "weights_ptr": "*bf16", "state_ptr": "*fp32", "lr_ptr": "*fp32", "eps": "fp32", **grad,
                }  # fmt: skip
                switches = {
                    "POOLED": pooled, "SCALED": scaled, "OPTIMIZER": optimizer, "STOCHASTIC": True,
                    "SHORT": update.SHORT_SEGMENT, "BLOCK_S": update.STEP_SEGMENTS, "BLOCK_D": 128,
                }  # fmt: skip
                compile_for_sm90("_segment_step_kernel", types, switches, update.STEP_LAUNCH[optimizer][0])
                print("_segment_step_kernel", segment, rows, pooled, scaled, optimizer)
        compile_for_sm90("_segment_starts_kernel", {"segment_ptr": segment}, {"BLOCK": 1024}, 4)
        print("_segment_starts_kernel", segment)
        level0 = segment == "*i32"
        # Level 0's listing (int32 segments) and a later level's, each with its launch's block sizes.
        switches = {
            "LEVEL0": level0, "SHORT": update.SHORT_SEGMENT, "SUB": update.SUM_BLOCK_N,
            "BLOCK_N": update.CROSSING_CHUNK if level0 else update.SUM_BLOCK_N,
            "BLOCK": update.FLAGS_BLOCK if level0 else 1024,
        }  # fmt: skip
        compile_for_sm90("_level_flags_kernel", {"segment_ptr": segment}, switches, 4)
        print("_level_flags_kernel", segment)
    types = {"grad_ptr": "*fp32", "sums_ptr": "*fp32", "partial_ptr": "*fp32"}
    switches = {"SPLIT_BF16": True, "OFFSET32": True, "BLOCK_N": 32, "BLOCK_D": 128}
    compile_for_sm90("_segment_sum_kernel", types, switches, 2)
    print("_segment_sum_kernel")
    compile_for_sm90("_gradient_rows_kernel", {"rows_ptr": "*i32"}, {"BLOCK": 1024}, 4)
    print("_gradient_rows_kernel")
    # A bag lookup's rows (`kernels.embedding_bag.index_dtype`) and one-hot's; with and without scales.
    for index, scaled in (("*i32", False), ("*i64", True)):
        types = {"index_ptr": index, "grad_ptr": "*bf16", "scales_ptr": "*fp32", "weights_ptr": "*fp32",
                 "lr_ptr": "*fp32"}  # fmt: skip
        switches = {
            "POOLED": True, "SCALED": scaled, "HOT": True, "HOT_ROWS": 16, "BLOCK_B": 16, "BLOCK_D": 128,
        }  # fmt: skip
        compile_for_sm90("_sgd_kernel", types, switches, 4)
        print("_sgd_kernel", index, scaled)


def test_the_sorted_update_kernels_compile_for_sm90_with_the_index_dtypes_they_take():
    from kernels.embedding_update import OPTIMIZERS

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    code = "from tests.test_update_compile import compile_all; compile_all()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * (3 * (1 + len(OPTIMIZERS)) + 2) + 2 + 2, lines
