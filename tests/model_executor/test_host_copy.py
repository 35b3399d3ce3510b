"""StagedCopy: a step's integer arrays, sent in one buffer (as on CUDA) or one by one (the CPU's default), come back
with their own shapes and values, contiguous, each its own memory (writing one never touches another)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.model_executor.host_copy import StagedCopy


@pytest.mark.parametrize("merge", [True, False])
def test_arrays_come_back_with_their_shapes_and_values(merge):
    table = np.arange(12).reshape(3, 4)
    arrays = [np.arange(5), np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32), [7], np.empty(0, dtype=np.int64),
              np.array([2**40]), table[:2, 1:3]]  # the last one a strided view, as a sliced block table
    staged = StagedCopy()
    handles = [staged.add(a) for a in arrays]
    tensors = staged.send(torch.device("cpu"), merge=merge)
    for handle, array in zip(handles, arrays):
        expected = np.asarray(array, dtype=np.int64)
        assert tensors[handle].dtype == torch.int64 and tuple(tensors[handle].shape) == expected.shape
        np.testing.assert_array_equal(tensors[handle].numpy(), expected)
    tensors[handles[0]][:] = -1  # one view's slice only
    np.testing.assert_array_equal(tensors[handles[1]].numpy(), [[1, 2, 3], [4, 5, 6]])
    assert tensors[handles[2]].tolist() == [7] and tensors[handles[4]].tolist() == [2**40]
    assert all(t.is_contiguous() for t in tensors)
    if merge:  # every array 16 bytes apart from the buffer's start (Triton specialises on pointers divisible by 16)
        assert all((t.data_ptr() - tensors[0].data_ptr()) % 16 == 0 for t in tensors if t.numel())
