"""A second CUDA stream for one branch of the forward, so that two independent branches run at once.

DLRM's sparse branch on many ranks (lookups, two all_to_all exchanges, the reordering of the vectors) does
not depend on the bottom MLP; run on a side stream, its exchanges overlap the bottom MLP's forward. Autograd
runs each backward op on the stream of its forward op (PyTorch's "stream semantics of backward passes"),
so the sparse branch's backward (the gradients' all_to_all, the tables' fused update) overlaps the bottom
MLP's backward too, and the engine makes each consumer wait for its producer's stream. Inside a CUDA
graph capture the fork and the join are recorded as event edges of the graph, so replays overlap the same
way. On a CPU (or with overlap off) the branch runs in line.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class SideStream:
    """`branch()` runs its block on this object's CUDA stream after the current stream's work so far;
    `join(t)` makes the current stream wait for the block and marks `t` (made on the side stream) as used
    by the current stream, so the caching allocator does not hand its memory out while the current stream
    still reads it. Without CUDA both are no-ops.

    Args:
        enabled: False makes both no-ops (one stream, as without this object).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if not self.enabled or device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @contextmanager
    def branch(self, device: torch.device) -> Iterator[None]:
        """Run the block on the side stream of `device` (in line without one)."""
        stream = self._stream(device)
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield

    def join(self, tensor: torch.Tensor) -> torch.Tensor:
        """The current stream waits for the side stream's work; returns `tensor` (made in `branch`)."""
        stream = self._stream(tensor.device)
        if stream is not None:
            current = torch.cuda.current_stream(tensor.device)
            current.wait_stream(stream)
            tensor.record_stream(current)
        return tensor
