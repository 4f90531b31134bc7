"""A batch split over two mesh axes (HSDP's ('replica', 'fsdp')) is the same global batch, on
the same devices, as a batch split over one axis of all the devices."""

import jax
import numpy as np
from models import toy_data

from jaxloop import data, partition
from jaxloop.launch import meshes


def _global_batches(partitioner, n=3):
    source = data.ArraySource(toy_data(256))
    it = iter(data.GlobalBatchDataset(source, 32, seed=0, partitioner=partitioner))
    return [partitioner.shard_batch(next(it)) for _ in range(n)]


def test_global_batch_dataset_over_two_data_axes_gives_the_one_axis_batches():
    one = partition.DataParallelPartitioner(meshes.make_mesh({"data": -1}), "data")
    two = partition.FSDPPartitioner(meshes.make_mesh({"replica": 2, "fsdp": -1}),
                                    ("replica", "fsdp"), fsdp_axis="fsdp")
    assert two.num_data_shards == one.num_data_shards == 8
    for a, b in zip(_global_batches(one), _global_batches(two), strict=True):
        for key in ("x", "y"):
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
            # Each device holds the same 4 rows under both meshes.
            rows_a = {s.device.id: np.asarray(s.data) for s in a[key].addressable_shards}
            rows_b = {s.device.id: np.asarray(s.data) for s in b[key].addressable_shards}
            assert rows_a.keys() == rows_b.keys() and len(rows_a) == jax.device_count()
            for device, rows in rows_a.items():
                assert rows.shape[0] == 4
                np.testing.assert_array_equal(rows, rows_b[device])
    # This process holds every data coordinate of both meshes: it reads whole batches.
    assert data.batch_rows(two.mesh, two.data_axis, 32) == (0, 32)
