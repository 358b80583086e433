"""selfspec/host.py: index tensors from Python ints."""
import gc

import torch

from selfspec.host import long_tensor


def test_long_tensor_holds_the_values_as_int64_and_outlives_the_list():
    values = torch.randint(-2**40, 2**40, (300,)).tolist()
    expected = torch.tensor(values)
    t = long_tensor(values)
    del values
    gc.collect()
    assert t.dtype == torch.long and torch.equal(t, expected)
    assert long_tensor([]).shape == (0,) and long_tensor([]).dtype == torch.long
