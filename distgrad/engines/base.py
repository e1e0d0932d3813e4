"""The one interface between the tracing core and a parallel engine.

The core (``trace.py``, ``envoy.py``, ``backward.py``, ``interleave/``) uses an engine only
through the attributes and methods of ``Engine`` below, and an engine's ``views`` of sharded
values only through those of ``ShardViews``; each engine (DDP, FSDP, DeepSpeed, accelerate,
tensor and pipeline parallel) is one file, or one folder, that implements them. The
single-process engine is ``local.py``. An engine that runs the trace body itself
(``captures_body``) serves the body's requests through the core's own seam: each body it runs
holds an ``interleave.requests.Requests`` of the engine's making.
"""

from __future__ import annotations

from typing import Any

import torch


class Engine:
    """How distgrad drives one wrapped object.

    * ``model`` is the user's own module tree: paths such as ``model.transformer.h[0]`` are
      looked up in it, so wrapper prefixes (``module.``, ``_fsdp_wrapped_module.``) never show.
    * ``forward`` calls the wrapper, so the engine's own forward hooks run.
    * ``root`` is the module whose output is ``model.output``.
    """

    #: The engine's short name (``"ddp"``, ``"fsdp2"``, ...), for messages and for the user.
    name = "base"
    #: How hook values are shown to the body: a ``ShardViews`` (below) where they are sharded
    #: across ranks, or None (the default): values as they are. The core reads it when it opens
    #: a forward or a backward block's session and hands it to that session, which calls the
    #: methods ``ShardViews`` declares. Tensor parallelism sets a ``TensorParallelViews``
    #: (``tensor_parallel.py``).
    views = None
    #: Whether the engine runs the trace body itself, once per piece of the step (pipeline
    #: parallelism: once per microbatch). The core reads it when a trace opens; if true it
    #: captures the body's code, skips it where the user wrote it, and hands it to
    #: ``run_captured`` when the block ends. Default False: the body runs where it is written.
    captures_body = False
    #: Whether the engine's ``backward`` is its own, which may scale or divide the loss itself
    #: (``accelerator.backward``, DeepSpeed's ``engine.backward``). The core reads it when a
    #: block opens with ``scaler=``, and refuses the scaler where it is true: the loss would
    #: be scaled twice, or by what the engine chose. Default False: a plain backward.
    own_backward = False

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    @property
    def model(self) -> torch.nn.Module:
        """The user's module tree, whose paths the body names. The core reads it once, when
        ``distgrad.wrap`` builds the ``Model``. Every engine defines it."""
        raise NotImplementedError

    @property
    def root(self) -> torch.nn.Module:
        """The module whose output is ``model.output``. The core reads it when the ``Model`` is
        built and when a trace first arms a hook point. Default: ``model``."""
        return self.model

    def forward(self, args: tuple, kwargs: dict, call=None):
        """Run the wrapped object's forward on the trace's inputs. The core calls it as the
        forward session's run, once per trace (once per batch with invokes). ``call``: what to
        call in place of the wrapped object, given by an engine around this one whose library
        is entered through its own wrapper (Fabric's module, ``around.py``), so that this
        engine's bookkeeping of the forward still runs. Every engine defines it."""
        raise NotImplementedError

    def generate(self, args: tuple, kwargs: dict):
        """Run generation, for ``model.generate(...)`` traces, as ``forward`` for ``trace``.
        Default: ``model.generate(*args, **kwargs)``."""
        return self.model.generate(*args, **kwargs)

    def backward(self, tensor: torch.Tensor, fn, args: tuple, kwargs: dict):
        """Run the real backward of ``tensor`` (``fn`` is the unpatched ``Tensor.backward``).
        The core calls it as the session's run of a ``with loss.backward():`` block inside a
        trace (once per batch with invokes). Default: ``fn(tensor, *args, **kwargs)``;
        accelerate runs ``accelerator.backward`` instead."""
        return fn(tensor, *args, **kwargs)

    def plain_backward(self) -> None:
        """A plain ``tensor.backward()`` (not a ``with`` block) is about to run in a trace's
        body, outside ``backward``: an engine that counts the backwards over one forward hears
        of it (DDP, ddp.py). The core calls it from the body's requests. Default: nothing."""

    def after_backward(self, roots: list) -> None:
        """The real backward of the tensors ``roots`` has just finished in a trace: a backward
        block's (once per batch with invokes, at the end of its run), a plain
        ``tensor.backward()`` in a body, or a traced step's (``Model.trace_step``). The core
        calls it on every rank in the same order, before the body goes on (so before any
        optimizer step). A multi-process engine reduces here the gradients of the parameters
        beside the model that the body brought into the graph (``ranks/beside.py``), or raises
        where it cannot. Default: nothing (one process: there is nothing to reduce)."""

    def owns(self, module: torch.nn.Module) -> bool:
        """Whether this process runs ``module``. Not called by the core: pipeline engines answer
        it per stage (their requests ask it), and engines that wrap another pass it on.
        Default True."""
        return True

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The user's module behind an engine's per-module wrapper (FSDP1 wraps submodules).
        The core calls it for every envoy it makes (each path the body names). Default: the
        module itself."""
        return module

    # -- what distgrad.flow reads (not the core) ----------------------------------------------
    def module_here(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The module this process runs for ``module`` of ``model``, or None where another
        process runs it (a pipeline stage's). Default: ``unwrap(module)``."""
        return self.unwrap(module)

    def output_holders(self, module: torch.nn.Module) -> list[int] | None:
        """The ranks of the job that hold the same plain tensor as this one when ``module``
        returns it (so that a norm over the job counts it once), or None: this rank alone (its
        own rows). Default: the tensor-parallel ranks where ``views`` says the value is not
        sharded among them; else None."""
        return None if self.views is None else self.views.output_holders(module)

    def refuse_flow(self) -> None:
        """Raise where distgrad.flow cannot record this engine's parameter gradients. Called
        by ``Recorder`` on every rank before it puts any hook on, whichever layers the rank
        runs, so that every rank raises (a rank that went on would wait in ``step()``'s
        collective). Default: nothing."""

    def watch_param_grads(self, take):
        """Where the engine's own step uses up the parameter gradients before a ``Recorder``'s
        ``step()`` can read them (DeepSpeed's pipeline engine steps the optimizer inside
        ``train_batch``): arrange for ``take()`` to be called on this rank once per step,
        after the gradients are reduced and before they are used, and return a function that
        undoes it. ``take`` reads ``grad_pieces`` and makes no collective. Default: None (the
        gradients outlive the step; ``Recorder.step()`` reads them itself)."""
        return None

    def grad_pieces(self, module: torch.nn.Module) -> list:
        """The gradients of ``module``'s parameters this process holds after the backward, as
        ``(tensor, copies)``: ``copies`` is how many ranks of the job hold that same tensor, or
        None where the tensor says: a DTensor by its placements, a plain tensor being the reduced
        gradient every rank holds. Default: each parameter's ``.grad``, copies None."""
        return [(p.grad, None) for p in module.parameters() if p.grad is not None]

    def param(self, param: torch.nn.Parameter, path: str):
        """What ``model.<path>`` gives for a parameter: one whose ``.grad`` is the full,
        reduced gradient (a collective on sharded engines) and can be assigned. The core calls
        it each time the body reads a parameter through an envoy. Default: the parameter."""
        return param

    def begin_trace(self) -> None:
        """Called on every rank when a trace opens, after the body has been captured or planned
        (multi-process engines start watching for a peer's failure). Default: nothing."""

    def end_trace(self, saves: list, error: BaseException | None):
        """Called on every rank when a trace ends, after its forward and backward finished.

        ``saves`` holds ``(value, gather, dim)`` per ``.save()``. Without ``error``: make the saved
        values global (one process: nothing to do). With ``error``: tell the other ranks. Returns
        an exception to raise instead of ``error``, or None (the default)."""
        return None

    def run_captured(self, trace, code, names: tuple, frame) -> None:
        """Run the captured trace body (``code``, compiled from the user's block; ``names``: the
        locals it binds; ``frame``: the user's frame, to give those names back). Called when the
        block ends, by engines with ``captures_body`` only. Each body it runs holds the engine's
        own ``requests.Requests``, which serves that body's requests. Default: raises
        ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not capture trace bodies")

    @property
    def rank(self) -> int:
        """This process's rank in the group saves are gathered over. Not called by the core
        (for users and engines). Default 0."""
        return 0

    @property
    def world_size(self) -> int:
        """The size of that group. Not called by the core (for users and engines). Default 1."""
        return 1


class ShardViews:
    """How an engine whose hook values are sharded across ranks shows each value whole to the
    body, and places the body's reply back as this rank's shard. An engine's ``views``; the
    core's session calls these methods at each hook value or gradient a body waits for, on every
    rank in the same order (every rank runs the same body), so an implementation may make one
    collective per call of ``show`` or ``show_grad``. ``place`` and ``place_grad`` cut locally.

    A *token* is the implementation's own record of one shown value, handed back unchanged to
    ``place``; a *split* is its record of how a gradient is sharded, from ``source`` or
    ``show_grad`` to ``show_grad`` or ``place_grad``. The core never looks inside either."""

    def show(self, kind: str, module: torch.nn.Module, value, label: str = "the value"):
        """The value the body sees at ``module``'s hook, as ``(shown, token)``. ``kind`` is
        ``"output"`` (``value``: what the module returned) or ``"input"`` (``value``:
        ``(args, kwargs)``); ``label`` (``model.h[0].output``) names it in errors. ``shown`` has
        ``value``'s structure with every sharded tensor replaced by the whole one; ``token`` is
        None where nothing in ``value`` was sharded (``shown`` is then ``value``, and ``place``
        is not called). Not called where every body waiting there asked for this rank's own
        value (``.local``)."""
        raise NotImplementedError

    def place(self, token, reply):
        """What the hook returns after the body was shown a value: ``reply`` is the body's
        assignment (whole values, in the shown value's structure) or None where it assigned
        nothing. Returns the value to go on with, its whole tensors cut back to this rank's
        shards (an in-place edit of a shown tensor counts as an assignment of it), or None where
        the body changed nothing. Raises ValueError where ``reply`` cannot be cut back."""
        raise NotImplementedError

    def source(self, tensor: torch.Tensor):
        """For a whole tensor of this trace (one ``show`` gave the body, or one the body
        assigned and ``place`` cut back): ``(tensor that flows on, split)``, the tensor to hook
        for this value's gradient and how that gradient is sharded. None for any other tensor
        (its gradient is hooked on itself and shown as it is)."""
        raise NotImplementedError

    def show_grad(self, split, grad: torch.Tensor):
        """The gradient the body sees, as ``(whole gradient, split)``: ``grad`` arrived at the
        tensor ``source`` named, sharded as ``split`` says; the split returned is the one
        ``place_grad`` takes (the gradient's own, where it says how it is sharded)."""
        raise NotImplementedError

    def place_grad(self, split, whole: torch.Tensor) -> torch.Tensor:
        """The gradient the hook returns for the body's assigned ``whole`` gradient: this
        rank's shard of it, as ``split`` (from ``show_grad``) says."""
        raise NotImplementedError

    def output_holders(self, module: torch.nn.Module) -> list[int] | None:
        """The ranks of the job that hold the same plain tensor as this one when ``module``
        returns it, or None where it is this rank's shard. ``Engine.output_holders``."""
        raise NotImplementedError

    def clear(self) -> None:
        """Let go of the trace's shown values (what ``source`` answers from), so that they do
        not outlive it. Called on every rank when a trace ends. Default: nothing."""
