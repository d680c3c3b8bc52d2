"""kernels.table_order: the one-pass gather into table order and its scatter back, against their PyTorch
reference (strided copies per table), in the interpreter on a CPU and compiled on a GPU."""

import pytest
import torch

from kernels.table_order import ColumnOrder


def _order(device: torch.device) -> tuple[ColumnOrder, list[int]]:
    """Blocks of 3 ranks and a local block; table 1 split over ranks 0 and 2, rank 1 holds none."""
    blocks = [[1, 0, 5], [], [4, 1], [2, 3]]
    columns = [[(q, j) for q, ts in enumerate(blocks) for j, t in enumerate(ts) if t == f] for f in range(6)]
    return ColumnOrder([len(ts) for ts in blocks], columns, device), [len(ts) for ts in blocks]


def _check(device: str, b: int, d: int, wire: torch.dtype, out_dtype: torch.dtype) -> None:
    order, widths = _order(torch.device(device))
    g = torch.Generator(device).manual_seed(0)
    back = torch.randn(b * d * sum(widths[:-1]), generator=g, device=device).to(wire)
    local = torch.randn(b, widths[-1], d, generator=g, device=device)
    out = order.gather(back, local, b, d, out_dtype)
    expected = order._gather_ref(back, local, b, d)
    tolerance = {} if out_dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert out.dtype == out_dtype and out.shape == (b, 6, d)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    grad = torch.randn(b, 6, d, generator=g, device=device).to(out_dtype)
    got = order.scatter(grad, b, d, 0.5, wire, torch.float32)
    want = order._scatter_ref(grad, b, d, 0.5, torch.empty_like(back), torch.empty_like(local))
    wire_tolerance = {} if wire == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got[0], want[0], **wire_tolerance)
    torch.testing.assert_close(got[1], want[1])
    # The gradient as the DCN interaction's backward hands it: a view of x0's gradient [b, (1 + F) d], the
    # dense part's columns first, read in place (rows 7 d apart).
    wide = torch.randn(b, 7 * d, generator=g, device=device).to(out_dtype)
    view = wide[:, d:].view(b, 6, d)
    assert not view.is_contiguous()
    in_place = order.scatter(view, b, d, 0.5, wire, torch.float32)
    copied = order.scatter(view.contiguous(), b, d, 0.5, wire, torch.float32)
    for a, e in zip(in_place, copied, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("wire", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_gather_and_scatter_match_their_reference(wire, out_dtype):
    _check("cpu", 19, 5, wire, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "wire", "out_dtype"), [(16, torch.float32, torch.float32), (128, torch.bfloat16, torch.bfloat16)]
)
def test_gather_and_scatter_match_their_reference_on_the_gpu(d, wire, out_dtype):
    _check("cuda", 70_001, d, wire, out_dtype)


def test_a_table_without_a_place_is_refused():
    with pytest.raises(ValueError, match="table 1"):
        ColumnOrder([1, 0], [[(0, 0)], []], torch.device("cpu"))
