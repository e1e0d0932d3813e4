"""What every job in tests/dist shares: comparing numbers, and running cases in one process
group with each case's outcome written per rank for pytest to read."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback

import torch.distributed as dist

ATOL = 1e-5


def close(a, b, what: str, atol: float = ATOL) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
    diff = (a - b).abs().max().item()
    if diff > atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {atol}")


def expect_failure_of_rank1(rank: int, run, must_say=("rank 1",), within: float = 30,
                            failing: int = 1) -> None:
    """``run()`` makes a trace whose body raises ZeroDivisionError on rank ``failing`` (1 unless
    given). That rank must get its own error; every other rank a RankFailedError saying
    ``must_say``, within ``within`` s."""
    import distgrad
    start = time.monotonic()
    try:
        run()
    except ZeroDivisionError:
        if rank != failing:
            raise
        return
    except distgrad.RankFailedError as exc:
        took = time.monotonic() - start
        if rank == failing or any(text not in str(exc) for text in must_say):
            raise AssertionError(f"wrong failure report on rank {rank}: {exc}")
        if took > within:
            raise AssertionError(f"the failure took {took:.1f} s to arrive")
        return
    raise AssertionError("no error reached this rank")


def expect_error(run, error, says: str, heard: bool = True) -> None:
    """``run()`` must raise ``error`` with ``says`` in its message on this rank or - when
    ``heard`` - a RankFailedError naming ``error``, from a rank that raised it first."""
    import distgrad
    try:
        run()
    except error as exc:
        if says not in str(exc):
            raise
        # what unwound distgrad's run on the way is not shown as the error's context
        assert type(exc.__context__).__name__ != "_Abort", "the error's context is an _Abort"
    except distgrad.RankFailedError as exc:
        if not heard or error.__name__ not in str(exc):
            raise
    else:
        raise AssertionError(f"no {error.__name__}")


RUNNING = "running: the rank never finished this case"
# How long a rank whose case failed waits for every other rank to finish that case too. A rank
# that has not finished by then is taken to be waiting for this one in a collective.
PEER_WAIT = 10.0
ENDED = "job ended"
RESUME = "resume at"
RESTART = 3  # the exit code that asks the launcher to start the ranks again (launch.py)


def _peer_results(out: str, rank: int, world: int) -> dict[int, dict]:
    found = {}
    for peer in range(world):
        if peer != rank:
            try:
                with open(os.path.join(out, f"rank{peer}.json")) as f:
                    found[peer] = json.load(f)
            except (OSError, ValueError):  # not written yet
                found[peer] = {}
    return found


def _unfinished_peers(out: str, rank: int, world: int, name: str) -> list[int]:
    """The ranks that neither finished case ``name`` nor ended the job within PEER_WAIT s."""
    ends = time.monotonic() + PEER_WAIT
    while True:
        peers = _peer_results(out, rank, world)
        missing = [peer for peer, res in peers.items()
                   if res.get(name, RUNNING) == RUNNING and ENDED not in res]
        if not missing or time.monotonic() > ends:
            return missing
        time.sleep(0.1)


def run_cases(cases, out: str, rank: int, *args) -> dict:
    """Run ``case(*args)`` for each case; ``out/rank{rank}.json`` says "ok" or the traceback,
    rewritten before and after every case (a rank that dies or hangs leaves what it had, and
    RUNNING marks the case it was in). Destroys the group; an error doing so is recorded as
    "teardown".

    Cases share one process group, so a case that fails on some ranks only can leave the
    others waiting in a collective that never completes. A rank whose case failed waits until
    every rank has finished that case; where one has not within PEER_WAIT s, it ends the job
    (exit code 1): its connections close, the waiting ranks' collectives fail, and they see
    ``ENDED`` in this rank's file after their case and end too. Cases not run say why.

    A failure inside a trace destroys the process group (distgrad's failure protocol), and a
    peer waiting in a collective with the failing rank is released only when that rank's
    process ends. So where the group is gone and cases remain, every rank records where to
    resume (``RESUME``) and exits with ``RESTART``; the launcher starts the ranks again, and
    run_cases goes on from there on a fresh group: each case shows its own failure, not the
    absence of the group."""
    faulthandler.register(signal.SIGTERM, chain=True)  # a stopped rank says where it was
    faulthandler.enable(all_threads=True)  # a crash or an abort shows every thread's stack too
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    try:  # a restarted job: what the ranks did before
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results = json.load(f)
    except (OSError, ValueError):
        pass
    resume = results.pop(RESUME, None)
    if resume is not None:
        cases = cases[[case.__name__ for case in cases].index(resume):]

    def write():
        path = os.path.join(out, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)  # peers never read half a file

    def end_job(why: str, later) -> None:
        results[ENDED] = why
        for case in later:
            results[case.__name__] = f"not run: {why}"
        write()
        print(f"rank {rank}: {why}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # closes this rank's connections now; no teardown that could wait

    for i, case in enumerate(cases):
        name = case.__name__
        results[name] = RUNNING
        write()
        try:
            case(*args)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"rank {rank} {name}:\n{results[name]}", file=sys.stderr)
        write()
        ended = {peer: res[ENDED] for peer, res in _peer_results(out, rank, world).items()
                 if ENDED in res}
        if ended:
            peer, why = next(iter(ended.items()))
            end_job(f"rank {peer} ended the job ({why})", cases[i + 1:])
        if world == 1:  # one process (no group): no peer to wait for or to release
            continue
        if not dist.is_initialized():  # peers may wait for this process to end: no waiting
            if i + 1 < len(cases):
                results[RESUME] = cases[i + 1].__name__
                write()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(RESTART)  # ends this rank's connections: a peer waiting in one fails
        elif results[name] != "ok":
            missing = _unfinished_peers(out, rank, world, name)
            if missing:
                end_job(f"{name} failed on rank {rank} while rank(s) {missing} had not finished "
                        f"it {PEER_WAIT:.0f} s later", cases[i + 1:])
    try:
        if dist.is_initialized():  # a failure case leaves it destroyed on every rank
            dist.destroy_process_group()
    except Exception as exc:  # recorded: a clean exit is part of the contract
        results["teardown"] = repr(exc)
        write()
    return results
