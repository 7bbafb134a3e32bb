import gc
import threading
import time

import numpy as np
import pytest
import torch

from dlrm.data.batch import Batch
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.loader import PrefetchLoader, batch_order
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.split_binary_writer import SplitBinaryWriter


class Source:
    """Batch i holds the value i everywhere, so order and content are easy to check."""

    def __init__(self, n=10, fail_at=None, delay=0.0):
        self.n, self.fail_at, self.delay = n, fail_at, delay
        self.reads = []

    def __len__(self):
        return self.n

    def read_batch(self, i):
        time.sleep(self.delay)
        self.reads.append(i)
        if i == self.fail_at:
            raise OSError(f"disk error at batch {i}")
        return Batch(torch.full((3, 2), float(i)), torch.full((3, 4), i), torch.full((3,), i % 2 == 1))


def test_batch_order():
    a = batch_order(100, epoch=0, seed=7, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert a.tolist() != list(range(100))
    np.testing.assert_array_equal(a, batch_order(100, epoch=0, seed=7, shuffle=True))  # reproducible
    expected = np.random.default_rng([7, 0]).permutation(100)
    np.testing.assert_array_equal(a, expected)
    assert batch_order(100, epoch=1, seed=7, shuffle=True).tolist() != a.tolist()
    assert batch_order(100, epoch=0, seed=8, shuffle=True).tolist() != a.tolist()
    assert batch_order(5, epoch=3, seed=7, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert batch_order(0, epoch=0, seed=0, shuffle=True).tolist() == []


def test_yields_batches_in_given_order():
    order = [4, 0, 9, 2, 2, 7]
    loader = PrefetchLoader(Source(), order, "cpu", prefetch=2)
    assert len(loader) == 6
    got = [int(b.categorical[0, 0]) for b in loader]
    assert got == order
    assert not loader.thread.is_alive()
    # a second pass works
    assert [int(b.categorical[0, 0]) for b in loader] == order


def test_same_batches_as_reader(tmp_path):
    spec = FeatureSpec.default(2, [7, 1000], splits=("train",), base_directory=str(tmp_path))
    rng = np.random.default_rng(0)
    n = 45
    with SplitBinaryWriter(spec, "train") as w:
        w.write(Batch(
            torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float16)),
            torch.from_numpy(np.stack([rng.integers(0, 7, n), rng.integers(0, 1000, n)], 1)),
            torch.from_numpy(rng.integers(0, 2, n).astype(bool)),
        ))
    reader = SplitBinaryReader(spec, "train", batch_size=8)
    order = batch_order(len(reader), epoch=0, seed=3, shuffle=True)
    loaded = list(PrefetchLoader(reader, order, torch.device("cpu"), prefetch=3))
    assert len(loaded) == len(order)
    for i, b in zip(order, loaded):
        ref = reader.read_batch(int(i))
        for x, y in zip((b.numerical, b.categorical, b.label), (ref.numerical, ref.categorical, ref.label)):
            assert x.dtype == y.dtype
            assert torch.equal(x, y)


def test_exception_surfaces_at_its_batch():
    loader = PrefetchLoader(Source(fail_at=3), range(10), "cpu")
    seen = []
    with pytest.raises(OSError, match="disk error at batch 3"):
        for b in loader:
            seen.append(int(b.categorical[0, 0]))
    assert seen == [0, 1, 2]
    loader.thread.join(timeout=5)
    assert not loader.thread.is_alive()


def test_close_mid_iteration_stops_thread():
    source = Source(n=1000)
    loader = PrefetchLoader(source, range(1000), "cpu", prefetch=2)
    it = iter(loader)
    next(it)
    next(it)
    thread = loader.thread
    assert thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)
    assert len(source.reads) < 10  # bounded read-ahead, no runaway thread


def test_close_from_loop_body():
    loader = PrefetchLoader(Source(n=100), range(100), "cpu")
    count = 0
    for _ in loader:
        count += 1
        if count == 3:
            loader.close()
    assert count == 3
    assert not loader.thread.is_alive()


def test_abandoned_iterator_stops_thread():
    loader = PrefetchLoader(Source(n=100), range(100), "cpu", prefetch=1)
    for _ in loader:
        break
    thread = loader.thread
    del _
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_dropped_loader_stops_thread():
    loader = PrefetchLoader(Source(n=100, delay=0.001), range(100), "cpu", prefetch=1)
    it = iter(loader)
    next(it)
    thread = loader.thread
    del it, loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert all(t.name != "PrefetchLoader" or not t.is_alive() for t in threading.enumerate())


def test_unstarted_iterator_stops_thread():
    loader = PrefetchLoader(Source(n=100), range(100), "cpu", prefetch=1)
    it = iter(loader)
    thread = loader.thread
    del it
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_rejects_bad_prefetch():
    with pytest.raises(ValueError):
        PrefetchLoader(Source(), [0], "cpu", prefetch=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_on_side_stream():
    order = list(range(10))[::-1]
    source = Source(n=10, delay=0.001)
    got = list(PrefetchLoader(source, order, "cuda", prefetch=3))
    for i, b in zip(order, got):
        assert b.categorical.is_cuda and b.label.is_cuda and b.numerical.is_cuda
        assert int(b.categorical[1, 3]) == i
        assert float(b.numerical.sum()) == 6.0 * i
    # batches already on the device pass through untouched
    on_device = Batch(torch.zeros(2, 1, device="cuda"), torch.zeros(2, 1, device="cuda"), torch.zeros(2, device="cuda"))

    class DeviceSource:
        def __len__(self):
            return 1

        def read_batch(self, i):
            return on_device

    (passed,) = list(PrefetchLoader(DeviceSource(), [0], "cuda"))
    assert passed.categorical.data_ptr() == on_device.categorical.data_ptr()
