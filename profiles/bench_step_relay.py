"""The host cost of relaying a step to the other tensor-parallel ranks (``graphrt.step_relay``).

Rank 0 sends each model call over the gloo control group before it launches the call itself, so the
send sits on every step's host path. This times that send with messages shaped as a steady decode step
of B sequences relays them (one appended token and a computed count a sequence, no table changes; every
16th step a table change a sequence, as a new block is taken), between ranks started as graphrt starts
them (spawned processes, gloo over loopback):

- ``send``: rank 0's ``broadcast_object_list`` call, what its step waits for;
- ``delivered``: from the send's start until every other rank has the message (each then replies through
  one gloo all-reduce, whose own time is measured alone and subtracted).

Medians of ``--steps`` messages after a warm-up, per batch size and rank count, printed and written as JSON.

    python profiles/bench_step_relay.py --ranks 2 4 --batch-sizes 1 8 64 256 --json step_relay.json
"""

import argparse
import json
import os
import pickle
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def step_message(batch: int, step: int) -> tuple:
    """A relayed ``launch_decode`` of ``batch`` sequences as ``RelayingRunner`` sends it: ids, one
    appended token and the computed count each, a table change each every 16th step."""
    updates = [(seq, [1000 + step], 2048 + step) for seq in range(batch)]
    tables = {seq: (list(range(seq * 130, seq * 130 + 129)), step) for seq in range(batch)} if step % 16 == 0 else {}
    return ("run", "launch_decode", (tuple(range(batch)),), {"ahead_from": list(range(batch))}, updates, tables, [])


def _rank(rank: int, size: int, port: int, batches: list[int], steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    flag = torch.zeros(1)
    results = {}
    for batch in batches:
        sends, delivered, replies = [], [], []
        for step in range(steps + 10):
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                dist.broadcast_object_list([step_message(batch, step)], src=0, device=torch.device("cpu"))
                sent = time.perf_counter()
                dist.all_reduce(flag)  # every rank has the message once this returns
                done = time.perf_counter()
                dist.barrier()
                reply_start = time.perf_counter()
                dist.all_reduce(flag)  # the reply alone
                reply = time.perf_counter() - reply_start
                if step >= 10:
                    sends.append(sent - start)
                    delivered.append(done - start)
                    replies.append(reply)
            else:
                box = [None]
                dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
                dist.all_reduce(flag)
                dist.barrier()
                dist.all_reduce(flag)
        if rank == 0:
            reply = statistics.median(replies)
            results[batch] = {
                "message_bytes": len(pickle.dumps(step_message(batch, 1))),
                "send_us": round(statistics.median(sends) * 1e6, 1),
                "delivered_us": round((statistics.median(delivered) - reply) * 1e6, 1),
                "reply_us": round(reply * 1e6, 1),
            }
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    report = {"cpus": os.cpu_count(), "torch": torch.__version__, "runs": {}}
    print(f"{'ranks':>5} {'batch':>5} {'bytes':>7} {'send us':>8} {'delivered us':>13}")
    for size in args.ranks:
        queue = context.Queue()
        port = 29500 + (os.getpid() + size) % 1000
        processes = [context.Process(target=_rank, args=(rank, size, port, args.batch_sizes, args.steps, queue))
                     for rank in range(size)]
        for process in processes:
            process.start()
        results = queue.get(timeout=600)
        for process in processes:
            process.join()
        report["runs"][size] = results
        for batch, row in results.items():
            print(f"{size:5d} {batch:5d} {row['message_bytes']:7d} {row['send_us']:8.1f} {row['delivered_us']:13.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
