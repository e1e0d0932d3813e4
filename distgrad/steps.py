"""``tracer.iter[...]`` and ``tracer.all()``: a loop of the body over the steps of a run.

nnsight's way to read a module called more than once (each step of ``generate``, a shared
layer) is a loop::

    with model.generate(ids, max_new_tokens=3) as tracer:
        for step in tracer.iter[1:3]:
            h = model.transformer.h[0].output.save()  # steps 1 and 2

While the loop runs step ``s``, a module value read without ``.call(i)`` is that module's
``.call(s)`` (``envoy.py``): the ``s``-th call counted from 0, as ``.call(i)`` counts. A
``generate`` run makes one call of the model per step, and each read is checked against it:
a module first named after generation started counts its calls from there, and a read
whose call is not in step ``s`` raises instead of handing over another step's value.

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
        self.before = None  # the step pinned before `with tracer.iter[i]:`, put back at its end

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
        before = body.step
        try:
            for step in self._indices():
                body.step = step
                yield step
        finally:
            body.step = before

    def __enter__(self):
        steps = list(self._indices()) if self.stop is not None or self.chosen else []
        if len(steps) != 1:
            raise TraceUsageError(
                "`with tracer.iter[...]:` pins one step (tracer.iter[2]); distgrad runs a "
                "with-block's body once, so a range of steps is a loop: "
                "`for step in tracer.iter[...]:`."
            )
        body = _body("with tracer.iter[...]")
        self.before, body.step = body.step, steps[0]
        return steps[0]

    def __exit__(self, *exc):
        body = current_body()
        if body is not None:
            body.step = self.before
        return False


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


def at_step(body, envoy, kind: str, at):
    """The pause at ``at`` (``envoy`` at the body's step: ``envoy.call(step)``), checked to be
    in that step of the run; a step the run did not make raises ``StepsEnded``."""
    step, requests = body.step, body.requests
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
