"""Tensor-parallel ranks: starting or joining their processes, and the channel over which rank 0 sends
each step to the others.

Every rank builds the same engine over its slice of the model (``graphrt.models.tensor_parallel``).
Rank 0 schedules; before each call that runs the model it sends the call (its sequences and the block
tables they read) to the other ranks, which make the same call on their own runner, so that every
rank runs the same forwards in the same order and their collectives meet. Logits are gathered on every
rank and sampled there alike (same seeds), so each rank's decode graphs feed their own samples to the
next step as on one rank.

Processes: graphrt starts ranks 1 .. N-1 itself (``torch.multiprocessing``, spawned: a script that
builds an engine needs the ``if __name__ == "__main__":`` guard), or, under ``torchrun`` with
``WORLD_SIZE`` equal to the size asked for, every process is a rank already and the others serve rank
0's steps from inside their engine's constructor until rank 0 closes.

Collectives of the model run over the default process group (NCCL for CUDA tensors, gloo for CPU ones);
the step messages over a gloo group of their own, which waits for rank 0 without a timeout (a rank
idle between requests is not a failure; a rank whose peer exits sees its connection close).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing.connection
import os
import signal
import socket
import weakref
from dataclasses import dataclass, field

import torch

from graphrt.base.errors import ConfigError, GraphrtError
from graphrt.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

#: How long rank 0 waits for a started rank to exit once it has been told to close.
_EXIT_WAIT_SECONDS = 60
#: How long a failed start waits for a started rank's report of its own failure.
_REPORT_WAIT_SECONDS = 5
#: The step channel's timeout: long enough for any idle period between requests.
_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class RankGroup:
    """This process's rank among ``size``, the collectives of its model (``tensor_parallel``), the
    step channel, and the processes it started (rank 0, when graphrt started them)."""

    rank: int
    size: int
    tensor_parallel: TensorParallel
    channel: object
    processes: list = field(default_factory=list)
    errors: object | None = None
    #: Whether this group set up torch.distributed's default group (and tears it down on close).
    owns_default_group: bool = False
    #: Whether torchrun started this process (not graphrt).
    launched_by_torchrun: bool = False
    #: Rank 0: set while a relayed call is under way, left set when one was interrupted (Ctrl-C, a failed
    #: rank): the others may then wait inside a forward this rank abandoned, so no message can reach
    #: them, and close stops the processes instead.
    out_of_step: bool = False
    closed: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, the others follow its steps."""
        return self.rank == 0

    def send(self, message: tuple, within_step: bool = False) -> None:
        """Rank 0: send ``message`` to every other rank (they ``receive`` it in the same order).
        ``within_step``: the message opens a relayed call, which has set ``out_of_step`` already."""
        self._check_ranks_alive()
        if self.out_of_step and not within_step:
            raise GraphrtError("a step of this tensor-parallel engine was interrupted (Ctrl-C or a failed rank), "
                               "so its ranks are out of step; close this engine and build a new one")
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.channel, device=torch.device("cpu"))

    def receive(self) -> tuple:
        """Ranks 1 .. N-1: the next message rank 0 sent."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.channel, device=torch.device("cpu"))
        return box[0]

    def agree_on_least(self, value: int) -> int:
        """The least of every rank's ``value`` (e.g. the KV blocks each rank's memory holds)."""
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.channel)
        return int(tensor.item())

    def _check_ranks_alive(self) -> None:
        failed = self.failed_rank()
        if failed:
            self.out_of_step = True
            raise GraphrtError(f"{failed}; close this engine")

    def failed_rank(self, wait: float = 0.0) -> str | None:
        """Rank 0: a sentence naming the started ranks that exited, with what they reported; None while
        all run. ``wait``: seconds to wait for an exit to register when none has (a collective broken by a
        killed rank can fail before that rank's exit is visible here)."""
        if wait > 0 and self.processes and all(process.is_alive() for process in self.processes):
            ended = multiprocessing.connection.wait([process.sentinel for process in self.processes], timeout=wait)
            for process in self.processes:
                if process.sentinel in ended:  # its exit status follows its sentinel's closing
                    process.join(wait)
        dead = [(rank, process.exitcode) for rank, process in enumerate(self.processes, start=1)
                if not process.is_alive()]
        if not dead:
            return None
        return (f"tensor-parallel rank(s) {', '.join(str(rank) for rank, _ in dead)} exited (exit code "
                f"{dead[0][1]}){_failure_report(self.errors, 1.0)}")

    def abandon(self) -> str:
        """After a failed start: stop the processes this rank started (they may be anywhere in their own
        start, so nothing is sent) and leave the process groups. Returns what a started rank reported
        of its own failure ("" for none)."""
        if self.closed:
            return ""
        self.closed = True
        reported = _failure_report(self.errors, _REPORT_WAIT_SECONDS) if self.processes else ""
        for process in self.processes:
            process.terminate()
            process.join(_EXIT_WAIT_SECONDS)
        self._leave_groups()
        return reported.removeprefix(": ")

    def _leave_groups(self) -> None:
        if self.owns_default_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def close(self) -> None:
        """Rank 0 tells the others to close (they leave their loop), waits for the processes it
        started; every rank then leaves the process groups it set up. Twice is a no-op."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.is_driver and not self.out_of_step and all(process.is_alive() for process in self.processes):
                self.send(("close",))
        finally:
            for process in self.processes:
                if self.out_of_step:  # nothing reaches them: they may wait inside an abandoned forward
                    process.terminate()
                process.join(_EXIT_WAIT_SECONDS)
                if process.is_alive():
                    logger.warning("tensor-parallel rank process %d did not exit; terminating it", process.pid)
                    process.terminate()
            self._leave_groups()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def under_torchrun(size: int) -> bool:
    """Whether this process is one of ``size`` started by ``torchrun`` (its environment says so)."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        return False
    if int(world) != size:
        raise ConfigError(f"tensor_parallel_size {size} under torchrun with WORLD_SIZE {world}: start as many "
                          "processes as ranks (torchrun --nproc-per-node N)")
    return True


def share_cpu_threads(size: int) -> None:
    """On the CPU each rank computes with its share of the cores (torch's default, every core in each
    rank, oversubscribed them: several times slower)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """The device of ``rank``: on CUDA the rank-th GPU counted from ``device``'s index, on the CPU the CPU."""
    if device.type != "cuda":
        return device
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + size > count:
        raise ConfigError(f"tensor_parallel_size {size} needs GPUs {first}..{first + size - 1}; torch sees {count}")
    return torch.device("cuda", first + rank)


def start_ranks(config, device: torch.device) -> RankGroup:
    """Rank 0's side: start ranks 1 .. N-1 (``config.tensor_parallel_size``) in processes of their own,
    each building an engine from ``config`` and serving this one's steps, and join them in the process
    groups; under torchrun, join the processes already started instead (this one's rank from the
    environment, which may be other than 0)."""
    size = config.tensor_parallel_size
    import torch.distributed as dist

    if under_torchrun(size):
        rank = int(os.environ["RANK"])
        owns = not dist.is_initialized()
        if owns:
            if device.type == "cuda":
                torch.cuda.set_device(rank_device(device, rank, size))
            dist.init_process_group(_backend(device))
        group = _group(rank, size, owns_default_group=owns)
        group.launched_by_torchrun = True
        if group.is_driver:  # a script that ends without closing: the other ranks still leave their loop
            _close_at_exit(group)
        return group
    import torch.multiprocessing as mp

    if dist.is_initialized():
        raise ConfigError("tensor_parallel_size > 1 while this process already has a torch.distributed group "
                          "(another tensor-parallel engine still open, or one set up outside torchrun): a process "
                          "holds one tensor-parallel engine at a time; close the other first")
    context = mp.get_context("spawn")
    errors, joining = context.Queue(), context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = []
    for rank in range(1, size):
        process = context.Process(target=_serve_rank, args=(config, rank, size, init_method, errors, joining),
                                  daemon=True, name=f"graphrt-rank-{rank}")
        process.start()
        processes.append(process)
    try:
        _wait_until_joining(processes, joining, errors)
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device, 0, size))
        else:
            share_cpu_threads(size)
        dist.init_process_group(_backend(device), init_method=init_method, rank=0, world_size=size)
        group = _group(0, size, owns_default_group=True)
    except BaseException:
        for process in processes:
            process.terminate()
        raise
    group.processes, group.errors = processes, errors
    _close_at_exit(group)
    return group


def _failure_report(errors, wait: float) -> str:
    """": " and what a started rank reported of its failure on ``errors``, waiting up to ``wait`` seconds
    for it (a rank that failed may still be on its way out); "" for nothing."""
    if errors is None:
        return ""
    try:
        return ": " + errors.get(timeout=wait)
    except Exception:  # nothing reported (killed, say)
        return ""


def _wait_until_joining(processes: list, joining, errors) -> None:
    """Rank 0, before it waits in the process group's rendezvous: wait until every started rank is about
    to join it, raising GraphrtError for one that exits first (its rendezvous would wait for it for
    half an hour)."""
    waiting = set(range(1, len(processes) + 1))
    while waiting:
        try:
            waiting.discard(joining.get(timeout=0.2))
            continue
        except Exception:  # none arrived: check the processes
            pass
        for rank in sorted(waiting):
            process = processes[rank - 1]
            if not process.is_alive():
                reported = _failure_report(errors, _REPORT_WAIT_SECONDS)
                raise GraphrtError(
                    f"tensor-parallel rank {rank}'s process exited (code {process.exitcode}) before joining"
                    f"{reported or ''}. Its process imports the main script: a script that builds a "
                    "tensor-parallel engine needs the `if __name__ == \"__main__\":` guard")


def _close_at_exit(group: RankGroup) -> None:
    """A script that ends without closing its engine: the started ranks are told to close at exit."""
    reference = weakref.ref(group)

    def close() -> None:
        alive = reference()
        if alive is not None:
            alive.close()

    atexit.register(close)


def _group(rank: int, size: int, owns_default_group: bool) -> RankGroup:
    import torch.distributed as dist

    channel = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return RankGroup(rank, size, TensorParallel(rank, size, group=None), channel,
                     owns_default_group=owns_default_group)


def _serve_rank(config, rank: int, size: int, init_method: str, errors, joining) -> None:
    """A started rank's process: join the groups, build the engine, serve rank 0's steps until it closes.
    Ctrl-C reaches every process of the terminal's group: rank 0 takes it (its engine closes the ranks),
    so this one ignores it rather than die under rank 0's feet."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch.distributed as dist

        from graphrt.config import resolve_device

        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device, rank, size))
        else:
            share_cpu_threads(size)
        joining.put(rank)
        dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=size)
        group = _group(rank, size, owns_default_group=True)
        from graphrt.engine import LLMEngine

        LLMEngine(config, progress=False, ranks=group)  # serves until rank 0 closes
    except BaseException as error:
        errors.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise
