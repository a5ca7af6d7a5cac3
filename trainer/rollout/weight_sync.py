"""Weight sync from trainer rank 0 to rollout engines over a dedicated torch.distributed group.

Parameters travel in flat buckets (one broadcast per bucket, not per tensor) over gloo on CPU or NCCL on
GPU; the receiving side copies each bucket back into its own parameters in the same order. Every
collective runs under the group's timeout, so a dead peer fails the sync instead of hanging it.
Under ZeRO-3 the caller passes parameters gathered a group of layers at a time; this module only sees
(name, tensor) pairs in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20


class SyncGroup:
    """A process group of its own (never the default one): trainer ranks under torchrun keep theirs.

    Rank 0 is the trainer and hosts the rendezvous store; ranks 1..N are rollout engines.
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
    ):
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def broadcast_weights(
    named: Iterable[tuple[str, torch.Tensor]],
    group: SyncGroup,
    src: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Sender side (rank `src`): broadcast every tensor; returns bytes sent."""
    sent = 0
    for bucket in buckets(
        ((n, t.detach()) for n, t in named), bucket_bytes
    ):  # lazily: ZeRO-3 gathers a group at a time
        flat = torch.cat([t.reshape(-1) for _, t in bucket])
        group.broadcast(flat, src)
        sent += flat.numel() * flat.element_size()
    return sent


@torch.no_grad()
def receive_weights(
    named: Iterable[tuple[str, torch.Tensor]],
    group: SyncGroup,
    src: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Receiver side: the same (name, tensor) order as the sender; tensors are overwritten in place."""
    received = 0
    for bucket in buckets(list(named), bucket_bytes):
        flat = torch.empty(
            sum(t.numel() for _, t in bucket), dtype=bucket[0][1].dtype, device=bucket[0][1].device
        )
        group.broadcast(flat, src)
        offset = 0
        for _, t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        received += flat.numel() * flat.element_size()
    return received


def _unique_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def sync_order(model) -> list[tuple[str, torch.Tensor]]:
    """The tensors that define the policy, in a fixed order both sides agree on (tied weights once)."""
    return [(name, p.data) for name, p in _unique_parameters(model)]


def sync_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The sender's side of `sync_order`: the same tensors in the same order, whole also when ZeRO-3 shards
    them (gathered a group at a time). Collective under ZeRO-3: every trainer rank iterates it to the end at
    the same moment, also those that send nothing."""
    from trainer.deepspeed_setup import gathered

    return gathered(_unique_parameters(model))
