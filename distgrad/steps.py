"""``tracer.iter[...]`` and ``tracer.all()``: a loop of the body over the steps of a run.

nnsight's way to read a module called more than once (each step of ``generate``, a shared
layer) is a loop::

    with model.generate(ids, max_new_tokens=3) as tracer:
        for step in tracer.iter[1:3]:
            h = model.transformer.h[0].output.save()  # steps 1 and 2

While the loop runs step ``s``, the body's requests are an ``AtStep`` over the trace's own, and
a module value read without ``.call(i)`` is that module's ``.call(s)``: the ``s``-th call
counted from 0, as ``.call(i)`` counts (a body outside a loop pays nothing for this). A
``generate`` run makes one call of the model per step: a module a loop names first counts its
calls from the start of generation, and each read is checked to be in its step, raising
rather than handing over another step's value (a module named in a step after it ran there).

A step the run does not make (``tracer.all()`` after the last token, ``tracer.iter[:10]``
with ``max_new_tokens=3``) ends the loop as nnsight ends it: the values saved in the steps
made are kept, a warning says the loop was cut short, and the rest of the body (or of the
invoke's body) does not run (``StepsEnded``, caught where the body ends).
"""

from __future__ import annotations

from .errors import OutOfOrderError, StepsEnded, TraceUsageError
from .interleave.session import current_body


class Steps:
    """``tracer.iter``, indexed: ``[i]``, ``[a:b]``, ``[a:]``, ``[:]``, ``[[i, j]]``. Iterate
    it with ``for step in ...``; ``with tracer.iter[i]:`` pins a single step."""

    __slots__ = ("start", "stop", "chosen", "before")

    def __init__(self, start: int = 0, stop: int | None = None, chosen: list | None = None):
        self.start, self.stop, self.chosen = start, stop, chosen
        self.before = None  # the body's requests before `with tracer.iter[i]:`, put back after

    def __getitem__(self, key) -> Steps:
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise TraceUsageError(
                    f"tracer.iter[{key.start}:{key.stop}:{key.step}]: a stride is not served; "
                    f"list the steps instead (tracer.iter[[0, 2, 4]])."
                )
            return Steps(_step(key.start or 0), None if key.stop is None else _step(key.stop))
        if isinstance(key, (list, tuple)):
            return Steps(chosen=[_step(k) for k in key])
        return Steps(_step(key), _step(key) + 1)

    def _indices(self):
        if self.chosen is not None:
            yield from self.chosen
            return
        step = self.start
        while self.stop is None or step < self.stop:
            yield step
            step += 1

    def __iter__(self):
        body = _body("for step in tracer.iter[...]")
        outer = body.requests
        try:
            for step in self._indices():
                body.requests = AtStep(outer, step)
                yield step
        finally:
            if isinstance(body.requests, AtStep):  # (not once the trace has let go of it)
                body.requests = outer

    def __enter__(self):
        steps = list(self._indices()) if self.stop is not None or self.chosen else []
        if len(steps) != 1:
            raise TraceUsageError(
                "`with tracer.iter[...]:` pins one step (tracer.iter[2]); distgrad runs a "
                "with-block's body once, so a range of steps is a loop: "
                "`for step in tracer.iter[...]:`."
            )
        body = _body("with tracer.iter[...]")
        self.before = body.requests
        body.requests = AtStep(self.before, steps[0])
        return steps[0]

    def __exit__(self, *exc):
        body = current_body()
        if body is not None and isinstance(body.requests, AtStep):
            body.requests = self.before
        self.before = None
        return False


class AtStep:
    """A body's requests while a ``tracer.iter`` loop is at ``step``: a module value read
    without ``.call(i)`` is read at the step (``at_step``); everything else is served by the
    trace's own requests, ``inner``. (Put in place of ``body.requests`` by the loop, so that a
    body outside any loop pays nothing for it.)"""

    __slots__ = ("inner", "step")

    def __init__(self, inner, step: int):
        self.inner = inner.inner if isinstance(inner, AtStep) else inner
        self.step = step

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def module_value(self, body, envoy, kind: str):
        if envoy._call is not None:
            return self.inner.module_value(body, envoy, kind)
        return at_step(self.inner, body, envoy, kind, self.step)


def _step(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceUsageError(f"tracer.iter[...]: a step is an int >= 0, got {value!r}.")
    return value


def _body(what: str):
    body = current_body()
    if body is None:
        raise TraceUsageError(
            f"{what} is used inside the body of `with model.generate(...) as tracer:` (or of "
            f"a trace), while the run is traced."
        )
    return body


def at_step(requests, body, envoy, kind: str, step: int):
    """The pause at ``envoy.call(step)``, checked to be in that step of the run; a step the
    run did not make raises ``StepsEnded``."""
    at = envoy.call(step)
    requests.name_for_steps(at, kind)
    try:
        pause = requests.module_value(body, at, kind)
    except OutOfOrderError as error:
        if requests.run_ended():
            raise StepsEnded(
                f"{envoy._path}.{kind} at step {step} was never reached: the loop asked for "
                f"a step the run did not make, so it was cut short. The values saved in the "
                f"steps it made are kept, and the statements after the loop did not run. An "
                f"open tracer.iter[:] / tracer.all() loop ends this way; to hold generate() "
                f"to a bounded loop's count, pass min_new_tokens=."
            ) from error
        raise
    made = requests.steps_made(envoy._module)
    if made is not None and made != step:
        raise OutOfOrderError(
            f"{envoy._path}.{kind} at step {step} was served in step {made} of generate(): "
            f"the trace first named this module in a step in which it had already run, and "
            f"its calls are counted from there. Read the modules in the order the model runs "
            f"them, naming this one before the model reaches it, or use "
            f"{envoy._path}.call(i) for its i-th call since it was first named."
        )
    return pause
