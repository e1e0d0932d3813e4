"""The floor one hand-off costs between a with-block body and its run, with no distgrad code.

    python benchmarks/diagnostics/handoff_floor.py [--rounds 20000] [--repeats 5]

A round trip is body -> run -> body, timed for: a greenlet switch pair (GreenletTransport);
ThreadTransport's lock pair (the body releases ``to_run``, a worker thread acquires it and releases
``to_body``, the body acquires that); the same pair with 20 non-blocking polls before each blocking
acquire (to skip a sleeping thread's wake-up); and what a reader might use instead between the same
two threads: ``threading.Condition`` wait/notify, two ``queue.SimpleQueue`` put/get pairs, two
``threading.Event`` set/wait/clear. Each runs bare (a no-op call on each side) and with
``x.add_(1)`` on a 16-element tensor on each side, to show that the switch sets the cost, not the
work between switches. No value is carried (a tuple or an attribute store: tens of ns).

Prints a markdown table of us per round trip (median and fastest of ``--repeats`` blocks of
``--rounds``), then the floor the README program's hand-offs set on a step in thread mode (a
CUDA backward) and in greenlet mode.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import greenlet
import torch


def nothing():
    return None


def adder():
    x = torch.zeros(16)
    return lambda: x.add_(1)


def no_handoff(op_run, op_body, n):
    """Each maker sets up a run that serves ``n`` round trips and returns (body_round, finish):
    body_round does the body's op and one round trip; finish lets the run end."""

    def body():
        op_body()
        op_run()

    return body, nothing


def greenlet_pair(op_run, op_body, n):
    def run():
        for _ in range(n):
            op_run()
            glet.parent.switch()

    glet = greenlet.greenlet(run)

    def body():
        op_body()
        glet.switch()

    return body, glet.switch  # the last switch lets run() return


def in_thread(run):
    thread = threading.Thread(target=run, daemon=True)  # as ThreadTransport's worker
    thread.start()
    return thread.join


def lock_pair(op_run, op_body, n):
    to_run, to_body = threading.Lock(), threading.Lock()
    to_run.acquire()
    to_body.acquire()

    def run():
        for _ in range(n):
            to_run.acquire()
            op_run()
            to_body.release()

    def body():
        op_body()
        to_run.release()
        to_body.acquire()

    return body, in_thread(run)


def _spin_then_block(lock, polls: int = 20) -> None:
    """Acquire ``lock``, polling first: ``time.sleep(0)`` releases the GIL between polls, so
    the other thread can run; a poll that wins skips the sleeping thread's wake-up."""
    for _ in range(polls):
        if lock.acquire(blocking=False):
            return
        time.sleep(0)
    lock.acquire()


def spinning_lock_pair(op_run, op_body, n):
    to_run, to_body = threading.Lock(), threading.Lock()
    to_run.acquire()
    to_body.acquire()

    def run():
        for _ in range(n):
            _spin_then_block(to_run)
            op_run()
            to_body.release()

    def body():
        op_body()
        to_run.release()
        _spin_then_block(to_body)

    return body, in_thread(run)


def condition(op_run, op_body, n):
    cond = threading.Condition()
    turn = ["body"]  # a flag under the condition's lock: a notify before the wait is not lost

    def run():
        for _ in range(n):
            with cond:
                cond.wait_for(lambda: turn[0] == "run")
                op_run()
                turn[0] = "body"
                cond.notify()

    def body():
        op_body()
        with cond:
            turn[0] = "run"
            cond.notify()
            cond.wait_for(lambda: turn[0] == "body")

    return body, in_thread(run)


def simple_queue(op_run, op_body, n):
    to_run, to_body = queue.SimpleQueue(), queue.SimpleQueue()

    def run():
        for _ in range(n):
            to_run.get()
            op_run()
            to_body.put(None)

    def body():
        op_body()
        to_run.put(None)
        to_body.get()

    return body, in_thread(run)


def event(op_run, op_body, n):
    go_run, go_body = threading.Event(), threading.Event()

    def run():
        for _ in range(n):
            go_run.wait()
            go_run.clear()  # before waking the body: its next set must not be cleared
            op_run()
            go_body.set()

    def body():
        op_body()
        go_run.set()
        go_body.wait()
        go_body.clear()

    return body, in_thread(run)


MAKERS = {
    "no hand-off (the two op calls only)": no_handoff,
    "greenlet switch pair": greenlet_pair,
    "lock pair (ThreadTransport)": lock_pair,
    "lock pair, 20 polls before blocking": spinning_lock_pair,
    "threading.Condition wait/notify": condition,
    "queue.SimpleQueue put/get x2": simple_queue,
    "threading.Event set/wait/clear x2": event,
}


def time_rounds(maker, with_op: bool, rounds: int, repeats: int) -> list[float]:
    """us per round trip of each of ``repeats`` blocks, after a warm-up block."""
    op_run, op_body = (adder(), adder()) if with_op else (nothing, nothing)
    warm = min(rounds, 1000)
    body, finish = maker(op_run, op_body, warm + rounds * repeats)
    for _ in range(warm):
        body()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(rounds):
            body()
        times.append((time.perf_counter_ns() - t0) / rounds / 1e3)
    finish()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20000, help="round trips per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per primitive")
    a = p.parse_args()
    torch.set_num_threads(1)  # no intra-op pool behind the add_: only the two threads switch
    rows = [
        (
            name,
            time_rounds(maker, False, a.rounds, a.repeats),
            time_rounds(maker, True, a.rounds, a.repeats),
        )
        for name, maker in MAKERS.items()
    ]
    med = {name: statistics.median(bare) for name, bare, _ in rows}
    lock, glet = med["lock pair (ThreadTransport)"], med["greenlet switch pair"]
    base = statistics.median(rows[0][2])  # the two add_ calls alone
    print(
        f"us per round trip (body -> run -> body), {a.rounds} round trips x {a.repeats}\n\n"
        "| hand-off | bare median | bare min | add_ both sides median | add_ min "
        "| add_ median less the adds alone | bare median / lock pair |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, bare, op in rows:
        print(
            f"| {name} | {statistics.median(bare):.2f} | {min(bare):.2f} "
            f"| {statistics.median(op):.2f} | {min(op):.2f} "
            f"| {statistics.median(op) - base:.2f} | {med[name] / lock:.2f}x |"
        )
    # The README step's hand-offs, counted by wrapping the transports' resume and hand: the
    # forward pauses at h[0].output and the logits (2 greenlet round trips in either mode); the
    # backward is 2 round trips, start -> the read's pause at a1.grad, reply -> the end. Each
    # further read+edit in the same backward block adds one round trip.
    print(
        "\nREADME step: the read+edit of a1.grad (the read's pause, the reply) spans 2 "
        f"backward round trips:\nthread mode 2 x {lock:.2f} = {2 * lock:.2f} us, greenlet "
        f"mode 2 x {glet:.2f} = {2 * glet:.2f} us ({lock / glet:.0f}x).\nWith the forward's "
        f"2 greenlet round trips: {2 * glet + 2 * lock:.2f} us a step in thread mode, "
        f"{4 * glet:.2f} us\nwith the backward in a greenlet."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
