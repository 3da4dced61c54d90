"""Joining the process group ``torchrun`` describes, sharding the global batch, naming collectives.

    torchrun --nproc-per-node 2 -m oomless train --parallel dp --global-batch 4

``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `join_process_group`
reads them through ``init_process_group``'s ``env://`` default. Several machines join through
torchrun's rendezvous (``--rdzv-backend c10d --rdzv-endpoint host:port``); nothing here changes.
"""

import atexit
import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import oomless.errors
from oomless.errors import CollectiveError, InputError, OomlessError
from oomless.parallel.config import ParallelConfig


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: its rank among ``world_size`` and whether it created the group."""

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_world_of_one_set_here = False     # RANK, WORLD_SIZE and MASTER_* were set by this process, not torchrun


def join_process_group(config: ParallelConfig, device: torch.device) -> Ranks:
    """Join (or reuse) the default process group; a single process without torchrun is world size 1."""
    if not config.distributed:
        return Ranks()
    if dist.is_initialized():
        guard_gloo_exit()
        return Ranks(dist.get_rank(), dist.get_world_size(), owns_group=False)
    global _world_of_one_set_here
    if "WORLD_SIZE" not in os.environ or _world_of_one_set_here:
        # Launched as a plain process: a world of one, so `--parallel dp` still runs (and equals plain).
        # A fresh port each time: an earlier run's store in this process may still hold its port.
        port = os.environ.get("MASTER_PORT") if not _world_of_one_set_here else None
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": port or str(_free_port())})
        _world_of_one_set_here = True
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(cuda_device_for_local_rank(int(os.environ.get("LOCAL_RANK", "0")),
                                                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend))
    try:
        dist.init_process_group(backend, store=_attempt_store(config.timeout_seconds),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=config.timeout_seconds))
    except Exception as error:
        raise CollectiveError(f"rank {os.environ.get('RANK')}: could not join the {backend} process group "
                              f"within {config.timeout_seconds:g} s: {_first_line(error)}") from error
    guard_gloo_exit()
    return Ranks(dist.get_rank(), dist.get_world_size(), owns_group=True)


def cuda_device_for_local_rank(local_rank: int, local_world_size: int, backend: str = "nccl") -> torch.device:
    """The GPU of the process ``local_rank`` of the ``local_world_size`` on this machine: ordinal
    ``local_rank % device_count``, so no process asks for a GPU that does not exist. Under NCCL each
    process needs a GPU of its own (NCCL refuses two ranks of one communicator on one device,
    "Duplicate GPU detected"): more processes than GPUs is refused here, before any is started."""
    count = torch.cuda.device_count()
    if count == 0:
        raise InputError("a CUDA device was asked for, but PyTorch sees no GPU here; use --device cpu")
    if backend == "nccl" and local_world_size > count:
        raise InputError(f"{local_world_size} processes on this machine need {local_world_size} GPUs under NCCL "
                         f"(one each: NCCL refuses two ranks on one GPU), and {count} is visible; start at most "
                         f"{count} (--nproc-per-node / --world-size {count}), or use --device cpu (gloo)")
    return torch.device("cuda", local_rank % count)


def guard_gloo_exit() -> None:
    """Under gloo, give its worker threads their grace period at exit (`_let_gloo_threads_finish`),
    also where the caller made the group: the threads outlive any run in this process."""
    if "gloo" in dist.get_backend():
        atexit.unregister(_let_gloo_threads_finish)     # once per process, however many runs join
        atexit.register(_let_gloo_threads_finish)


def _attempt_store(timeout_seconds: float) -> dist.Store:
    """The rendezvous store, its keys under this restart attempt's own prefix.

    After `torchrun --max-restarts` restarts the workers, a store that still holds the dead
    attempt's keys hands gloo the dead peers' addresses (connection refused); a prefix per attempt
    (TORCHELASTIC_RESTART_COUNT) keeps every attempt's rendezvous apart.
    """
    timeout = timedelta(seconds=timeout_seconds)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout,
                          wait_for_workers=False)
    return dist.PrefixStore(f"oomless/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def leave_process_group(ranks: Ranks) -> None:
    """Destroy the group if `join_process_group` created it, after a failed collective as well: a later
    run in this process must create a fresh group, not reuse a broken one. Under gloo this does not stop
    the group's threads (see `_let_gloo_threads_finish`)."""
    if ranks.owns_group and dist.is_initialized():
        dist.destroy_process_group()


# Long enough for a runnable thread to be scheduled on a loaded machine; paid once, at process exit.
_GLOO_EXIT_GRACE_SECONDS = 0.2


def _let_gloo_threads_finish() -> None:
    """At exit, before Python finalizes: give gloo's worker threads the GIL and the CPU for a moment.

    A gloo worker thread keeps working after the collective's caller has been woken: it drops the work
    (whose tensors were created in Python, so releasing them takes the GIL: torch 2.13 decrefs a
    tensor's Python object when C++ lets go of it), runs Python future callbacks (the overlapped
    update's step), and a barrier's work frees the earlier works it waited for. Once Python finalizes,
    a thread that asks for the GIL is ended with ``pthread_exit``, whose unwinding through torch's
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active exception"
    and SIGABRT, after a run that finished (the rank that does not save returns first) or after a
    failed collective (the failing works are still being released); torch checks only
    ``Py_IsInitialized()`` before taking the GIL (pytorch/pytorch#190489). Stopping the threads first is not
    possible here: gloo's ``shutdown()`` and ``abort()`` do nothing in torch 2.13, and the threads end
    only in the group's destructor, which never runs while DDP and its comm hook still hold the group
    (they do until the process exits). What a worker has left is microseconds of work; this sleep, with
    the GIL released, lets it run. atexit handlers run before Python marks itself finalizing.
    """
    time.sleep(_GLOO_EXIT_GRACE_SECONDS)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@contextlib.contextmanager
def named_collective(name: str, timeout_seconds: float | None = None):
    """Turn a failed or timed-out collective inside the block into a `CollectiveError` that says which
    rank saw it and which collective it was; torch's own message only names a socket or a work id."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:       # DistBackendError and gloo/NCCL timeouts are RuntimeErrors
        if not dist.is_initialized():
            raise
        limit = f" (timeout {timeout_seconds:g} s)" if timeout_seconds else ""
        raise CollectiveError(f"rank {dist.get_rank()} of {dist.get_world_size()}: collective "
                              f"'{name}' failed{limit}: {_first_line(error)}") from error


def refusal_or(compute):
    """What ``compute()`` returns, or the oomless error it raises (returned, for `first_rank_outcome`).
    Errors other than oomless's are not caught: they are bugs, and the rank ends with their traceback."""
    try:
        return compute()
    except OomlessError as error:
        return error


def first_rank_outcome(outcome, group: dist.ProcessGroup | None = None) -> str:
    """The first rank of ``group``'s (default: the world) ``outcome``, on every rank of it: the string
    it computed (JSON), returned, or the oomless error it got (`refusal_or`), raised on every rank alike.

    Where one rank decides for all (a plan, a pipeline's cut), a refusal there must reach the others:
    otherwise they wait in their next collective until its timeout, or fail there with "connection
    closed by peer", neither of which says what was wrong. Other ranks' outcomes are dropped, their
    refusals too (where every rank plans, the first rank's plan is the one all of them run)."""
    shared = [shareable(outcome) if dist.get_rank(group) == 0 else None]
    # src as a global rank: ``group_src`` is newer than the torch 2.4 the project allows.
    dist.broadcast_object_list(shared, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if isinstance(outcome, OomlessError) and dist.get_rank(group) == 0:
        raise outcome       # the first rank's own, with its traceback and every attribute
    return from_shared(shared[0])


def shareable(outcome) -> dict:
    """``outcome`` (a value, or an oomless error) as plain data that a collective can carry; `from_shared`
    gives the value back or raises the error."""
    if not isinstance(outcome, OomlessError):
        return {"value": outcome}
    # Only the message and plain attributes travel (a PlanError's profile does not, nor any traceback).
    # The message first: a deferred PlanError (`PlanError.deferred`) works out its numbers when read.
    message = str(outcome)
    plain = {key: value for key, value in vars(outcome).items() if isinstance(value, (str, int, float, type(None)))}
    return {"error": type(outcome).__name__, "message": message, "attributes": plain}


def from_shared(shared: dict) -> str:
    if "error" not in shared:
        return shared["value"]
    kind = getattr(oomless.errors, shared["error"], None)
    if not (isinstance(kind, type) and issubclass(kind, OomlessError)):
        kind = OomlessError
    error = kind(shared["message"])
    vars(error).update(shared["attributes"])
    raise error


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Equal shards only: with uneven shards DDP's mean of means is not the global mean, and a rank with
    fewer batches would wait forever in a collective its peers never start."""
    if global_batch % world_size:
        raise InputError(f"global batch {global_batch} does not split evenly over {world_size} processes; "
                         f"use a multiple of {world_size}")
    return global_batch // world_size


def shard_start(step: int, global_batch: int, ranks: Ranks) -> int:
    """Index of this rank's first item at ``step``: rank r takes items r*b .. r*b+b-1 of the global batch,
    so the ranks' shards laid end to end are exactly the one-process batch."""
    return step * global_batch + ranks.rank * local_batch_size(global_batch, ranks.world_size)


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient. Rank r's loss L_r reads the global
    sum S = sum_k x_k, and DDP averages what each rank computes for its own x_r; the gradient of the
    ranks' mean loss with respect to x_r is (1/N) sum_k dL_k/dS, so each rank's backward must be
    handed sum_k dL_k/dS: the all-reduce of every rank's incoming gradient (DDP supplies the 1/N).

    Written out rather than taken from torch's functional all-reduce, whose differentiability has
    changed between releases (``torch.distributed.nn.functional.all_reduce`` is deprecated)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        total = tensor.detach().clone(memory_format=torch.contiguous_format)
        # async_op=False: on NCCL the current stream waits for the collective (no host synchronisation).
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        total = gradient.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


# Run eagerly inside a compiled block (a graph break): torch 2.11's dynamo traced the forward's
# all-reduce but dropped this Function's backward (the input's gradient came out as if the backward
# returned zeros, 3.0 off in a two-rank probe). torch 2.13 traces both correctly; the break costs it
# a second graph per compiled block that calls it (the soft Dice's sums under gloo; `GlobalBatchNorm`
# breaks the same way).
@torch.compiler.disable
def sum_across_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-reduce (sum) over ``group`` (default: the world): its backward all-reduces the
    gradient, so a loss term computed from the global sum sends each rank the gradient for its own
    contribution (`_SumAcrossRanks`). Every rank must call it, in the same order, in forward and backward."""
    return _SumAcrossRanks.apply(tensor, group)