"""selfspec/host.py: index tensors from Python ints."""
import gc

import torch

from selfspec.host import long_tensor, packed_positions


def test_long_tensor_holds_the_values_as_int64_and_outlives_the_list():
    values = torch.randint(-2**40, 2**40, (300,)).tolist()
    expected = torch.tensor(values)
    t = long_tensor(values)
    del values
    gc.collect()
    assert t.dtype == torch.long and torch.equal(t, expected)
    assert long_tensor([]).shape == (0,) and long_tensor([]).dtype == torch.long


def test_packed_positions_are_the_spans_back_to_back():
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (9, 4, 20)]
    spans = [(texts[0], 2, 9), (texts[1], 0, 4), (texts[2], 17, 18)]
    ids, pos = packed_positions(spans)
    assert ids.shape == pos.shape == (1, 12) and ids.dtype == pos.dtype == torch.long
    assert ids[0].tolist() == texts[0][2:9] + texts[1] + texts[2][17:18]
    assert pos[0].tolist() == [*range(2, 9), *range(4), 17]
