from __future__ import annotations

import numpy as np

from gemps.records import Shard
from gemps_worker.sharding import epoch_batches, shard_indices


def test_disjoint_shards_cover_the_data_once() -> None:
    parts = [shard_indices(103, Shard(i, 4)) for i in range(4)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))


def test_whole_dataset_mode_gives_each_worker_its_own_order() -> None:
    a = np.concatenate(list(epoch_batches(256, Shard(0, 0), 64, epoch=0)))
    b = np.concatenate(list(epoch_batches(256, Shard(1, 0), 64, epoch=0)))
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(256))
    assert not np.array_equal(a, b)


def test_every_batch_is_full() -> None:
    assert all(len(b) == 64 for b in epoch_batches(200, Shard(0, 0), 64, epoch=3))
