"""A Ray cluster of several nodes on this machine, as Ray tests itself (``ray.cluster_utils``):
a head with no CPUs of its own and ``workers`` worker nodes, loopback only, no dashboard, no usage
statistics. The caller's process is connected to it as a driver for the ``with`` block; leaving the
block disconnects and stops every node."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster


@contextmanager
def local_cluster(namespace: str, cpus_per_worker: int, object_store_mib: int,
                  workers: int = 2) -> Iterator[Cluster]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    worker = {"num_cpus": cpus_per_worker, "object_store_memory": object_store_mib * 2**20,
              "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**worker, "num_cpus": 0,
                                                            "include_dashboard": False})
    for _ in range(workers):
        cluster.add_node(**worker)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
