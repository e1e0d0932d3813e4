"""The backward's side of the protocol: where a body's ``.grad`` pauses the backward
(``grad_pause``), the error when the backward has passed that gradient (``grad_passed``), which
transport a backward needs (``backward_threaded``, ``step_threaded``), and how a block's session
ends (``close_session``). Every ``Requests`` that serves gradients in one process uses these;
``backward.py`` (the block users open) sits above them.
"""

from __future__ import annotations

import torch

from ..config import config
from ..errors import GradientError
from .checkpointing import no_grad_message, read_without_grad
from .points import GradPoint
from .session import UNSET, Body, Session


def backward_threaded(tensor) -> bool:
    mode = config.backward_mode
    if mode == "auto":
        return tensor.device.type != "cpu" or torch.cuda.is_initialized()
    return step_threaded()


def step_threaded() -> bool:
    """Whether a run that contains a backward (a pipeline step) needs a worker thread."""
    mode = config.backward_mode
    if mode == "auto":
        return torch.cuda.is_initialized()
    if mode not in ("greenlet", "thread"):
        raise ValueError(
            f"distgrad.config.backward_mode must be 'auto', 'greenlet' or 'thread', not {mode!r}."
        )
    return mode == "thread"


def grad_pause(body: Body, tensor: torch.Tensor):
    """Where the body reads or writes ``tensor.grad``: pause the backward there. The callers
    (the ``.grad`` property) have found that the body is not already at that gradient."""
    block = body.block
    session = block.session
    if session.single_body:  # one body, whole values: no views, no rows to split
        if not tensor.requires_grad:
            raise _no_grad_flows(body, tensor)
        # No lookup of an earlier point for this tensor: its gradient arrives once per
        # backward, so a second request of it is out of order with a new point as with the old.
        point = GradPoint(session, tensor)
        return session.request_single(
            body, (point, 0), lambda: grad_passed(block.tensor, tensor, body), tensor
        )
    target, split = tensor, None
    if session.views is not None:  # a value shown whole: hook the shard that flows on
        found = session.views.source(tensor)
        if found is not None:
            target, split = found
    if not target.requires_grad:
        raise _no_grad_flows(body, tensor)
    point = session.points.get(id(target))
    if point is None or point.tensor is not target:
        point = session.grad_point(target, new=True)
    if split is not None:
        point.split = split
    passed = lambda: grad_passed(block.tensor, tensor, body, target)  # noqa: E731
    return session.request(body, (point, point.calls), passed, UNSET, tensor)


def _no_grad_flows(body: Body, tensor) -> GradientError:
    if read_without_grad(tensor):  # read inside a use_reentrant=True checkpointed block
        return GradientError(no_grad_message(body.label_of(tensor)))
    return GradientError(
        f"{body.label_of(tensor)}.grad: no gradient flows into it, because it does "
        f"not require grad (computed under torch.no_grad() or from frozen inputs "
        f"only)."
    )


def grad_passed(root: torch.Tensor, tensor: torch.Tensor, body: Body, target=None):
    label = body.label_of(tensor)  # worded only on this error path: naming is dear
    if not _reaches(root.grad_fn, tensor if target is None else target):
        return ValueError(
            f"{label}.grad: the backward of {body.label_of(root)} finished without a "
            f"gradient reaching {label}; it is not on the path from that tensor to the "
            f"inputs. Open the backward block on a tensor computed from {label}."
        )
    earlier = _read_before(body, tensor)
    example = f" ({label}.grad before {earlier}.grad)" if earlier else ""
    return (
        f"{label}.grad was requested after the backward had passed it. Gradients arrive in "
        f"reverse-forward order: request the .grad of values computed later in the forward "
        f"first{example}."
    )


def _read_before(body: Body, tensor) -> str | None:
    """The label of the value the body read last before ``tensor`` in the forward, among those
    a gradient can reach: a real path for the error's example."""
    earlier = None
    for value, path, kind in body.labels.values():
        if value is tensor:
            return earlier
        if value.requires_grad:
            earlier = path + kind
    return None


def _reaches(start, tensor) -> bool:
    """Whether the graph from ``start`` leads to ``tensor`` (its grad_fn, or for a leaf its
    AccumulateGrad node). Only used to word an error, so a full walk is fine."""
    target = tensor.grad_fn
    seen, todo = set(), [start]
    while todo:
        fn = todo.pop()
        if fn is None:
            continue
        if fn is target or (target is None and getattr(fn, "variable", None) is tensor):
            return True
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        todo.extend(f for f, _ in fn.next_functions)
    return False


def close_session(session: Session, error) -> None:
    """End a backward block's session: finish it, or abort it on ``error``; close it."""
    try:
        if error is None:
            session.finish()
        else:
            session.abort()
    finally:
        if not session.finished:
            session.abort()
        session.close()
