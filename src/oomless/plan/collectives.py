"""Seconds of the collectives a parallel layout runs, by the alpha-beta (latency-bandwidth) model.

    ring_all_reduce_seconds(2**30, 8, 360e9, 3e-6)          # one link, n ranks in a ring
    all_reduce_seconds(cluster, Group(8, 8), 2**30)          # 64 ranks: 8 per node on 8 nodes, two levels

Ring formulas, S the bytes of the whole tensor, n ranks, B bytes per second of each rank's link,
alpha the latency of one step (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 69(2), 2009; Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 19(1), 2005):

- all-reduce: 2 (n - 1) / n * S / B + 2 (n - 1) alpha (a reduce-scatter then an all-gather);
- all-gather, reduce-scatter: (n - 1) / n * S / B + (n - 1) alpha (S: the gathered size);
- point-to-point: S / B + alpha.

Across nodes the group is taken as ``per_node`` ranks on each of ``nodes`` nodes and the collective
runs in two levels (hierarchical, as NCCL's tree / CollNet and Horovod's hierarchical all-reduce do),
not as one ring at the slowest link's speed:

- all-reduce: reduce-scatter within each node (NVLink), all-reduce of the node's 1 / per_node share
  between nodes (``per_node`` rings in parallel, one per rail: every GPU has its own NIC), all-gather
  within each node;
- all-gather: all-gather of the 1 / per_node shares between nodes, then within each node;
  reduce-scatter: the mirror image, the same time.

With one node (or one rank per node) each reduces to the flat ring formula on that link. Links'
rates are those a collective reaches (`Cluster.effective`: datasheet x efficiency).

BatchNorm under data parallel (`batchnorm_sync_seconds`): the trainer normalises by the statistics of
every replica's shard (`oomless.parallel.batchnorm`), so each BatchNorm layer runs collectives inside
forward and backward that compute waits for. Under NCCL, torch's ``SyncBatchNorm``
(torch/nn/modules/_functions.py): forward all-gathers (mean, invstd, count) of every rank, 2C + 1
floats each; backward all-reduces two sums of C floats. Under gloo, oomless's ``GlobalBatchNorm``:
forward all-gathers each rank's per-channel mean and variance (2C floats), backward all-reduces two
sums of C floats. Small tensors: the latency terms dominate.
"""

from dataclasses import dataclass

from oomless.plan.cluster import Cluster


def ring_all_reduce_seconds(num_bytes: float, ranks: int, bytes_per_second: float, latency_seconds: float) -> float:
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * num_bytes / bytes_per_second + 2 * (ranks - 1) * latency_seconds


def ring_all_gather_seconds(num_bytes: float, ranks: int, bytes_per_second: float, latency_seconds: float) -> float:
    """``num_bytes``: the gathered tensor (each rank holds 1 / ranks of it before)."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / bytes_per_second + (ranks - 1) * latency_seconds


def ring_reduce_scatter_seconds(num_bytes: float, ranks: int, bytes_per_second: float,
                                latency_seconds: float) -> float:
    """``num_bytes``: the tensor each rank holds whole before (and 1 / ranks of, reduced, after)."""
    return ring_all_gather_seconds(num_bytes, ranks, bytes_per_second, latency_seconds)


def point_to_point_seconds(num_bytes: float, bytes_per_second: float, latency_seconds: float) -> float:
    if num_bytes <= 0:
        return 0.0
    return num_bytes / bytes_per_second + latency_seconds


@dataclass(frozen=True)
class Group:
    """A process group: ``per_node`` ranks on each of ``nodes`` nodes."""

    per_node: int
    nodes: int = 1

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


def consecutive_group(cluster: Cluster, size: int) -> Group:
    """The group of ``size`` consecutive ranks (rank r on node r // gpus_per_node). A size that is
    not a multiple of the node's GPUs past one node is taken as whole nodes (an approximation)."""
    per_node = min(size, cluster.gpus_per_node)
    return Group(per_node, -(-size // per_node))


def all_reduce_seconds(cluster: Cluster, group: Group, num_bytes: float) -> float:
    intra, inter = cluster.effective(cluster.intra_node), cluster.effective(cluster.inter_node)
    if group.nodes == 1:
        return ring_all_reduce_seconds(num_bytes, group.per_node, *intra)
    if group.per_node == 1:
        return ring_all_reduce_seconds(num_bytes, group.nodes, *inter)
    return (ring_reduce_scatter_seconds(num_bytes, group.per_node, *intra)
            + ring_all_reduce_seconds(num_bytes / group.per_node, group.nodes, *inter)
            + ring_all_gather_seconds(num_bytes, group.per_node, *intra))


def all_gather_seconds(cluster: Cluster, group: Group, num_bytes: float) -> float:
    """``num_bytes``: the gathered tensor."""
    intra, inter = cluster.effective(cluster.intra_node), cluster.effective(cluster.inter_node)
    if group.nodes == 1:
        return ring_all_gather_seconds(num_bytes, group.per_node, *intra)
    if group.per_node == 1:
        return ring_all_gather_seconds(num_bytes, group.nodes, *inter)
    return (ring_all_gather_seconds(num_bytes / group.per_node, group.nodes, *inter)
            + ring_all_gather_seconds(num_bytes, group.per_node, *intra))


def reduce_scatter_seconds(cluster: Cluster, group: Group, num_bytes: float) -> float:
    """``num_bytes``: the tensor each rank holds whole before the reduction."""
    return all_gather_seconds(cluster, group, num_bytes)


def send_seconds(cluster: Cluster, num_bytes: float, across_nodes: bool) -> float:
    """One point-to-point transfer between neighbouring ranks, within a node or across nodes."""
    link = cluster.inter_node if across_nodes else cluster.intra_node
    return point_to_point_seconds(num_bytes, *cluster.effective(link))


def batchnorm_sync_seconds(cluster: Cluster, group: Group, channels: list[int]) -> tuple[float, float]:
    """(forward, backward) seconds of collectives that BatchNorm layers of ``channels`` channels
    each run to normalise over ``group``'s shards (module docstring); 0 for a group of one."""
    if group.size <= 1:
        return 0.0, 0.0
    forward = backward = 0.0
    for count in channels:
        statistics = 4 * count        # fp32 statistics, whatever the activations' dtype
        if cluster.backend == "gloo":
            forward += all_gather_seconds(cluster, group, 2 * statistics * group.size)
            backward += all_reduce_seconds(cluster, group, 2 * statistics)
        else:
            forward += all_gather_seconds(cluster, group, (2 * statistics + 4) * group.size)
            backward += all_reduce_seconds(cluster, group, 2 * statistics)
    return forward, backward
