"""Checkpoints of tables of any size (dlrm.checkpoint, dlrm.staging): the writers that stage a bounded share
of the state on the host."""

import tracemalloc

import torch

from dlrm import checkpoint, staging

# ---------------------------------------------------------------------------------------------------------
# Bounded host memory


def test_a_checkpoint_file_is_written_in_chunks_and_loads_as_torch_save_wrote_it(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "CHUNK_BYTES", 2**20)
    table = torch.randn(2**21, 8)  # 64 MiB: one storage, as the "triton" tables' weights
    state = {
        "model": {"w": table, "view": table[5:9], "b": torch.arange(7)},
        "embedding_optimizer_state": table.square(),
        "config": {"name": "x"},
        "table_rows": [3],
        "step": 4,
    }
    path = tmp_path / "last.pt"
    tracemalloc.start()
    checkpoint.save_checkpoint(path, **state)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # well under the 128 MiB of tensors (torch.save to a stream: all of it)
    assert checkpoint.verify_checksum(path)
    loaded = torch.load(path, weights_only=True)  # torch.save's format
    assert torch.equal(loaded["model"]["w"], table) and torch.equal(loaded["model"]["view"], table[5:9])
    view, whole = loaded["model"]["view"], loaded["model"]["w"]
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # one storage, as saved
    assert torch.equal(loaded["embedding_optimizer_state"], table.square()) and loaded["step"] == 4


def test_a_device_storage_goes_through_one_host_buffer_of_at_most_chunk_bytes(
    monkeypatch,
):
    monkeypatch.setattr(staging, "CHUNK_BYTES", 1000)
    storage = torch.arange(2600, dtype=torch.int16).to(torch.uint8).untyped_storage()
    chunks = list(checkpoint._host_chunks(storage))
    assert [start for start, _ in chunks] == [0, 1000, 2000]
    assert all(len(chunk) <= 1000 for _, chunk in chunks)
    assert b"".join(bytes(chunk) for _, chunk in chunks) == bytes(storage)
