"""The one protocol: a body asks for a value, the run goes on until the hook that makes it
fires, the hook hands the value over and waits, the body reads or replaces it, and its next
request sends the reply back to the hook.

* ``requests.py``: ``Requests``, the seam: what a body asks for, served by one object per trace;
* ``forward_requests.py``: ``ForwardRequests``, one body in the caller's frame over the trace's
  one forward; ``invoke.py``: ``Invokes``, several bodies over one batch;
* ``session.py``: ``Body``, ``Pause`` (the body's view of the paused run) and ``Session`` (the
  points and bodies of one run);
* ``points.py``: where a hook pauses the run (a module call's input or output, a tensor's
  gradient); ``checkpointing.py``: the same points in a checkpointed block's recompute;
* ``transports.py``: how control moves between body and run, one interface with one hand-off
  (``hand(key, value) -> reply``) and two implementations: a greenlet on the body's thread, or
  a worker thread where autograd calls hooks on its own threads;
* ``gradients.py``: the backward's side (``.grad`` requests, which transport a backward needs);
  ``scaling.py``: gradients shown unscaled under a loss scaler (``backward(scaler=...)``);
* ``step.py``: ``StepRequests``, a body over another library's training step, whose loss and
  backward are that library's (``model.trace_step``);
* ``batching.py``: rows of a batch per invoke (``token_ids.py``: ids of different lengths
  padded); ``in_order.py``: invokes whose rows overlap (an empty invoke) served one after
  another.

Modules here import one another and distgrad's leaves (``config``, ``errors``,
``torch_internals``, ``capture``) only: the user-facing objects above (trace, envoy, backward
block) call down into them.
"""
