"""Which samples a worker trains on, from the shard the server assigned."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gemps.records import Shard


def shard_indices(num_samples: int, shard: Shard) -> np.ndarray:
    """count == 0: every sample (the GEM paper's setting); else the index-th of count slices."""
    if shard.count == 0:
        return np.arange(num_samples)
    return np.array_split(np.arange(num_samples), shard.count)[shard.index % shard.count]


def epoch_batches(num_samples: int, shard: Shard, batch_size: int, epoch: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Mini-batches of sample indices for one epoch, in an order of this worker's own."""
    indices = shard_indices(num_samples, shard)
    rng = np.random.default_rng([seed, shard.index, epoch])
    order = rng.permutation(indices)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield order[start : start + batch_size]
