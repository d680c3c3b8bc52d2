"""numpy <-> arrow for fixed-width columns, without pyarrow's pandas bridge.

`pa.array(ndarray)`, `pa.scalar(x)` and `Array.to_numpy()` import pandas (to check for pandas objects, or
through the conversion code they share with `to_pandas`), which costs a preprocess run ~0.15 s to import
and ~0.1 s at exit while nothing in it needs pandas. These build the same arrays from the buffers instead,
without copying where the layout allows.
"""

import numpy as np
import pyarrow as pa


def from_numpy(values: np.ndarray) -> pa.Array:
    """[n] contiguous numeric `values` (not bool) as an arrow array of their type, sharing their memory."""
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def to_numpy(column: pa.Array | pa.ChunkedArray, dtype: type[np.generic]) -> np.ndarray:
    """The values of a numeric `column` of type `dtype` (its null slots hold unspecified values) as one
    [n] array: a view of the buffer for a single chunk, else a copy of the chunks one after the other."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    itemsize = np.dtype(dtype).itemsize
    views = [
        np.frombuffer(c.buffers()[1], dtype=dtype, count=len(c), offset=c.offset * itemsize)
        for c in chunks
        if len(c)
    ]
    if len(views) == 1:
        return views[0]
    return np.concatenate(views) if views else np.empty(0, dtype=dtype)
