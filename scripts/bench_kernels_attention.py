"""The attention interaction's part of scripts/bench_kernels.py (`--what attention`): the masked attention op
alone and the whole "attention" interaction, per path (eager SDPA, compile, compile-ops: the plain ops
compiled, triton: kernels.attention), forward and forward + backward, launched and as graph replays."""

from pathlib import Path

import torch
import torch.nn.functional as F
from bench_timing import DTYPES, PASSES, ROTATE, time_passes
from results_csv import append_rows

from dlrm.config import AttentionConfig
from dlrm.model.dlrm import InteractionArch
from kernels.attention import masked_attention

ATTENTION_RESULTS = Path(__file__).parent / "results" / "attention.csv"


def _attention_inputs(m: int, heads: int, dim: int, dtype: torch.dtype, g: torch.Generator):
    qkv = torch.randn(m, 27, 3, heads, dim, device="cuda", dtype=dtype, generator=g).requires_grad_()
    valid = torch.rand(m, 27, device="cuda", generator=g) >= 0.2
    valid[:, 0] = True  # the dense vector: always a valid key
    return qkv, valid


def plain_attention(q, k, v, valid):
    """softmax(q k^T / sqrt(d)) v over [B, heads, 27, d] with keys where `valid` [B, 27] is False masked
    out, in plain ops (the softmax in fp32, as SDPA computes it)."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def bench_attention(path: str, op: str, m: int, heads: int, dim: int, dtype: torch.dtype) -> dict[str, float]:
    """Median ms of the attention op or the whole attention interaction on one path (module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(m + heads * dim)
    sets = []
    if op == "attention":
        for _ in range(ROTATE):
            qkv, valid = _attention_inputs(m, heads, dim, dtype, g)
            sets.append((qkv, valid, torch.randn(m, heads, 27, dim, device="cuda", dtype=dtype, generator=g)))

        def split(qkv):
            return (t.transpose(1, 2) for t in qkv.unbind(2))

        if path == "triton":
            fn = lambda qkv, valid: masked_attention(*split(qkv), valid)  # noqa: E731
        elif path == "compile-ops":
            torch._dynamo.reset()
            fn = torch.compile(lambda qkv, valid: plain_attention(*split(qkv), valid), dynamic=False)
        else:

            def fn(qkv, valid):
                return F.scaled_dot_product_attention(*split(qkv), attn_mask=valid[:, None, None, :])

            if path == "compile":
                torch._dynamo.reset()
                fn = torch.compile(fn, dynamic=False)
        return time_passes(fn, sets, path.startswith("compile"))
    d = 16
    cfg = AttentionConfig(heads=heads, layers=2, dim=dim)
    arch = InteractionArch(d, "attention", kernel="triton" if path == "triton" else "torch", attention=cfg)
    arch = arch.to(device="cuda", dtype=dtype)
    for _ in range(ROTATE):
        dense = torch.randn(m, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
        embedded = torch.randn(m, 26, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
        sparse = torch.randint(0, 1000, (m, 26), device="cuda", generator=g)
        sparse[torch.rand(m, 26, device="cuda", generator=g) < 0.2] = -1
        dy = torch.randn(m, arch.out_features, device="cuda", dtype=dtype, generator=g)
        sets.append((dense, embedded, sparse, dy))
    fn = arch
    if path == "compile":
        torch._dynamo.reset()
        fn = torch.compile(arch, dynamic=False)
    return time_passes(fn, sets, path == "compile")


def run_attention(batches, precisions, shapes, paths, common) -> None:
    """`--what attention`: rows to ATTENTION_RESULTS; per (op, precision, batch, shape) times and ratios.
    Each shape's rows are appended as soon as they are timed, so a run cut short keeps what it measured."""
    print(f"\nattention interaction, ms (ratio = eager / path), {common['device']}")
    for op in ("attention", "interaction"):
        # compile-ops is a baseline of the attention op alone (the interaction's eager module is compiled
        # by "compile").
        op_paths = [p for p in paths if op == "attention" or p != "compile-ops"]
        print(
            f"{'op':<13}{'prec':<6}{'B':>7}  {'HxD':<7}{'pass':<15}" + "".join(f"{p:>20}" for p in op_paths)
        )
        for precision in precisions:
            for m in batches:
                for shape in shapes:
                    heads, dim = (int(v) for v in shape.split("x"))
                    times = {p: bench_attention(p, op, m, heads, dim, DTYPES[precision]) for p in op_paths}
                    rows = []
                    for ps in PASSES:
                        base = times[op_paths[0]][ps]
                        cells = "".join(
                            f"{times[p][ps]:>10.4f} ({base / times[p][ps]:>5.2f}x)" for p in op_paths
                        )
                        print(f"{op:<13}{precision:<6}{m:>7}  {shape:<7}{ps:<15}{cells}")
                        for path in op_paths:
                            rows.append(dict(
                                common, op=op, heads=heads, dim=dim, seq=27, batch=m, precision=precision,
                                path=path, **{"pass": ps}, ms=round(times[path][ps], 5),
                                ratio_vs_eager=round(base / times[path][ps], 3),
                                compile_s=round(times[path]["compile_s"], 2),
                            ))  # fmt: skip
                    append_rows(ATTENTION_RESULTS, rows)
