"""Make certain the race a gloo worker thread can lose while its process exits
(tests/test_distributed.py::test_a_collective_given_up_on_does_not_abort_the_exit).

Rank 0's process ends while rank 1 holds the GIL, in C, into the interpreter's shutdown, so
that a collective rank 1 gave up on fails on a worker thread that then waits for the GIL until
the shutdown has begun. A worker that frees a tensor Python holds there aborts the process
(the fix: distgrad/engines/ranks/abandoned.py).

Imported by job.py before anything else, and with the standard library only: exit handlers run
last first, so rank 1's hold, registered first, is the last thing before the shutdown (a
handler after it would run bytecode and hand the GIL over too early).

At exit rank 1 writes a mark, then holds the GIL for about 3 s in C (``sum`` over a range,
called by the exit machinery itself: no bytecode, so no thread can take the GIL from it);
rank 0 waits for the mark and ends its process meanwhile.
"""
import atexit
import os
import time


def arm(out: str, rank: int) -> None:
    mark = os.path.join(out, "rank1-exiting")
    if rank == 0:
        def wait_for_rank1():
            ends = time.monotonic() + 60
            while not os.path.exists(mark) and time.monotonic() < ends:
                time.sleep(0.05)
        atexit.register(wait_for_rank1)
    elif rank == 1:
        atexit.register(sum, range(int(3.0 * 6e7)))  # runs last: about 3 s of C, no bytecode
        atexit.register(lambda: open(mark, "w").close())
