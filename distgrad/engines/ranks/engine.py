"""What every multi-process engine shares: ranks, the end-of-trace gather, and failure.

A failure on one rank must reach all of them without a hang:

* The failing rank writes ``"<rank>\n<message>"`` to the job's store under a key for the current
  trace, destroys its process group and re-raises its own error; when its script ends, its
  connections close, and every peer blocked in a collective with it (DDP's all-reduce, FSDP's
  all-gather, distgrad's gather) fails.
* A peer's failed collective arrives in the trace as a communication error; the peer raises
  ``RankFailedError`` naming the failing rank and its message, and its own script ending closes
  the next connections (a ring on 4 ranks fails rank by rank).
* The peer may only fail after the store's host has exited (without torchrun's agent the store
  lives in rank 0), so a watcher thread per engine reads the key while a trace runs and keeps
  the message; rank 0 waits, at most ``3 x distgrad.config.failure_timeout`` seconds, until
  every peer has read it before it returns.
* A rank that dies without a word (killed) closes its connections the same way; the others
  wait at most ``failure_timeout`` seconds for a message, then report a lost rank.

After a failure the process group is gone on every rank: guard teardown with
``if dist.is_initialized(): dist.destroy_process_group()``.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ...config import config
from ...errors import RankFailedError
from ...interleave.session import current_body
from ...saving import LabelledSaves
from ...torch_internals import default_store
from ..base import Engine
from .abandoned import keep_until_exit
from .agreement import Agreement, asked, where
from .beside import OwnedLeaves, label, mean_over, params_beside, refuse_unreduced
from .gather import SavesGather, refuse_model_state


class DistributedEngine(Engine):
    sharded_params = False  # True: a parameter's .grad through distgrad is a collective

    def __init__(self, wrapped, group=None, gather: bool = True):
        super().__init__(wrapped)
        if not dist.is_initialized():
            raise RuntimeError(
                f"distgrad.wrap() got a {type(wrapped).__name__} but "
                "torch.distributed is not initialised in this process."
            )
        # DDP and FSDP1 wrappers carry their process group; otherwise the default one
        group = group if group is not None else getattr(wrapped, "process_group", None)
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)  # within the group saves are gathered over
        self._world = dist.get_world_size(self.group)
        # failures are told to the whole job, by global rank (the gather group may be smaller:
        # the data-parallel dimension of a 2-D mesh)
        self.job_rank, self.job_world = dist.get_rank(), dist.get_world_size()
        self._traces = 0  # traces ended (incremented as end_trace starts)
        self.running = 1  # the number of the trace running, or of the last one (keys use it)
        # gather=False: every rank already holds the global values (tensor parallel alone)
        self.saves_gather = (
            SavesGather(self.group, self._rank, self._world, wait=self.wait_in_slices)
            if gather
            else None
        )
        # held here so that it outlives the process group we destroy on a failure (without
        # torchrun's agent, the store's server lives in rank 0's process)
        self.store = _store()
        self.failure_watcher = FailureWatcher(self)
        # rank-dependent requests raise instead of hanging (agreement.py): parameter gradients
        # of sharded engines here, tensor-parallel views in tensor_parallel.py
        self.agreements: list = []
        # what this rank's failure watcher asks to say where the rank is when a waiting peer
        # asks (``publish_state``): the agreements, and a pipeline step's messages while it runs
        self.answering: list = []
        self.owned = OwnedLeaves(self.engine_params)  # what is not beside the model
        self.forward_output = None  # the trace's forward's output, while no backward ran
        self.backward_ran = False
        self.param_agreement = None
        if self.sharded_params and dist.get_backend() == "gloo":
            self.param_agreement = Agreement(self, "params")

    # The wrapper is what runs the forward, and its output is model.output; engines whose
    # wrapper keeps the user's model elsewhere (DDP's .module) override ``model``.
    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped

    @property
    def root(self) -> torch.nn.Module:
        return self.wrapped

    def forward(self, args, kwargs, call=None):
        self.backward_ran = False
        output = (call or self.wrapped)(*args, **kwargs)
        # kept until a backward runs in the trace, or the trace ends (see _end_trace); a body's
        # plain backward may have run already, before the forward returned
        ran = self.backward_ran or not torch.is_grad_enabled()
        self.forward_output = None if ran else output
        return output

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    # -- parameters beside the model (beside.py) -------------------------------------------
    def after_backward(self, roots) -> None:
        self.forward_output, self.backward_ran = None, True  # a backward ran in the trace
        if self.reduces_beside():
            params = params_beside(roots, self.owned)
            if params:
                self.reduce_beside(params)

    def reduces_beside(self) -> bool:
        """Whether the backward that just ran reduces parameters beside the model (DDP: not
        inside ``no_sync()``). Default True: a mean more is never wrong (it is linear)."""
        return True

    def engine_params(self) -> list:
        """The leaves whose gradients the engine reduces itself: the wrapped model's parameters
        (an engine adds its internal leaves)."""
        return [*self.wrapped.parameters(), *self.model.parameters()]

    def reduce_beside(self, params: list) -> None:
        """Average the gradients of ``params`` (parameters beside the model the backward
        reached) over the data-parallel group; an engine whose values are sharded across ranks
        raises instead (its ranks hold parts of them, which no mean makes whole)."""
        if self.views is not None:
            raise NotImplementedError(
                f"a trace body brought a parameter beside the model ({label(params[0])}) into "
                f"the backward under tensor parallelism: each rank's gradient of it is only "
                f"the part its shards reached, which distgrad cannot make whole. Register it "
                f"on the model and parallelize it with the plan, or mark it with "
                f"distgrad.keep_rank_local(param) and reduce its gradient yourself."
            )
        mean_over(params, self.group, self.wait_in_slices)

    # -- the start and end of every trace -------------------------------------------------
    def begin_trace(self) -> None:
        self.running = self._traces + 1
        self.failure_watcher.active.set()
        if self.saves_gather is not None:
            # name each saved gradient too, so that the gather can check that the ranks saved
            # the same values (gather.py): the trace's body is current while it opens
            body = current_body()
            if body is not None:
                body.saves = LabelledSaves(body)

    def end_trace(self, saves: list, error: BaseException | None):
        try:
            return self._end_trace(saves, error)
        finally:
            self.failure_watcher.active.clear()

    def wait_in_slices(self, work, group, after_slice=lambda: None) -> None:
        """Wait for a collective on ``group`` in slices of ``failure_timeout`` seconds, reading
        the failure key after each slice, then calling ``after_slice``. (A timed wait on a
        collective closes nothing; on a gloo receive it would close the whole group: see
        ``../pipeline/messages.py``.) Leaving with the collective still pending keeps ``group``
        and ``work`` until the process exits (``abandoned.py``)."""
        try:
            while True:
                try:
                    if work.wait(timedelta(seconds=config.failure_timeout)):
                        return
                except RuntimeError as exc:
                    if "timed out" not in str(exc).lower():
                        raise
                self.check_failure()
                after_slice()
        except BaseException:
            keep_until_exit(group, [work])
            raise

    def check_failure(self, ask_the_store: bool = True) -> None:
        """Raise, as a broken connection would, if a rank has failed in this trace: as the
        failure watcher has seen it (every 0.1 s, and it outlives the store's host), or, with
        ``ask_the_store``, as the store says now."""
        key = self.key_now()
        found = self.failure_watcher.seen.get(key)
        if found is None and ask_the_store:
            found = self.failure_watcher.read(key)
        if found is not None:
            raise RuntimeError(f"Connection closed: {found[1]}")

    def agree(self, label: str) -> None:
        """Before a collective for a parameter's gradient (see ``agreement.py``)."""
        if self.param_agreement is not None:
            self.param_agreement.agree(label)

    def _end_trace(self, saves: list, error: BaseException | None):
        self._traces += 1
        output, self.forward_output = self.forward_output, None
        for agreement in self.agreements:
            agreement.clear()
        if self.views is not None:
            self.views.clear()
        if error is not None:
            return self._fail(error)
        refused = refuse_unreduced(output, self.owned) if output is not None else None
        if refused is not None:  # every rank alike: the ranks run the same body
            self._fail(refused)
            return refused
        if self.saves_gather is None:
            return None
        refused = refuse_model_state(saves, self.model) if saves else None
        if refused is not None:  # every rank alike: the ranks run the same body
            self._fail(refused)
            return refused
        try:
            self.saves_gather(saves)  # rebinds saved tensors: the user's names see global values
        except RuntimeError as exc:  # the group broke under us: a peer failed
            raise self._peer_failure(exc) from exc
        return None

    def _key(self) -> str:
        return f"distgrad/failure/{self._traces}"

    def key_now(self) -> str:
        """The failure key of the trace now running (also while it ends)."""
        return f"distgrad/failure/{self.running}"

    def _fail(self, error: BaseException):
        if isinstance(error, RankFailedError):
            return None
        if _is_comm_error(error):
            return self._peer_failure(error)
        self.tell(self._key(), error)
        _break_connections()
        return None  # re-raise the user's own error on this rank

    def tell(self, key: str, error: BaseException) -> bool:
        """Write ``error`` under the failure ``key`` for the peers; False if the store is gone
        (the store's host may have exited; the peers then say "lost")."""
        try:
            self.store.set(
                key, f"{self.job_rank}\nrank {self.job_rank}: {type(error).__name__}: {error}"
            )
            return True
        except Exception:
            return False

    def _peer_failure(self, error: BaseException) -> RankFailedError:
        key = self._key()
        deadline = time.monotonic() + config.failure_timeout
        found = self.failure_watcher.seen.get(key)
        while found is None and time.monotonic() < deadline:
            found = self.failure_watcher.read(key)
            if found is None:
                time.sleep(0.05)
        _break_connections()
        if found is None:
            return RankFailedError(
                f"rank {self.job_rank}: a peer rank stopped answering during the trace (killed or "
                f"crashed without a Python error): {str(error).splitlines()[0][:200]}"
            )
        failing, message = found
        if self.job_rank == 0:
            self.wait_for_readers(key, failing, 3 * config.failure_timeout)
        return RankFailedError(f"rank {self.job_rank} stopped because {message}")

    def wait_for_readers(self, key: str, failing: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        readers = [f"{key}/read/{r}" for r in range(self.job_world) if r not in (0, failing)]
        try:
            while readers and not self.store.check(readers) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass


class FailureWatcher:
    """A daemon thread per engine (its ``failure_watcher``) that, while a trace runs, reads the
    trace's failure key every 0.1 s, so that a peer knows the message before the store's host is
    gone, and answers a waiting peer's question where this rank is (``answering``). Between traces
    it sleeps and touches nothing; it ends with the engine."""

    def __init__(self, engine: DistributedEngine):
        self.store, self.rank = engine.store, engine.job_rank
        self.seen: dict = {}
        self.stopped = threading.Event()
        self.active = threading.Event()  # set from the start of a trace to the end of end_trace
        ref = weakref.ref(engine)
        self.thread = threading.Thread(
            target=self._loop, args=(ref,), daemon=True, name=f"distgrad-failure-watch-{self.rank}"
        )
        self.thread.start()
        # Stop and join before the interpreter tears down: a daemon thread killed in the middle
        # of a store call at exit can abort the process ("terminate called without an active
        # exception").
        atexit.register(self.stop)

    def stop(self) -> None:
        self.stopped.set()
        self.active.set()  # wake the loop so that it sees `stopped`
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)

    def read(self, key: str):
        try:
            if not self.store.check([key]):
                return None
            failing, message = self.store.get(key).decode().split("\n", 1)
            self.store.set(f"{key}/read/{self.rank}", "1")
        except Exception:
            return None
        self.seen[key] = (int(failing), message)
        return self.seen[key]

    def _loop(self, ref) -> None:
        while True:
            self.active.wait()
            if self.stopped.wait(0.1):
                return
            engine = ref()
            if engine is None or not dist.is_initialized():
                return
            key = engine.key_now()  # the trace now running, also in its end-of-trace gather
            running, answering = engine.running, list(engine.answering)
            del engine
            if key not in self.seen:
                self.read(key)
            if answering:  # where this rank is, if a waiting peer asks
                try:
                    if asked(self.store, running):
                        now = where()
                        for one in answering:
                            one.publish_state(self.store, self.rank, running, now)
                except Exception:
                    pass


def _is_comm_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "gloo" in text or "NCCL" in text or "Connection closed" in text or "Read error" in text
    )


def _store():
    return default_store()


def _break_connections() -> None:
    """Close this rank's connections so that every peer's pending collective fails now."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
