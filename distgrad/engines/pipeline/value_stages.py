"""The pipeline stage each value handed to a body came from, and the refusal of an edit whose
gradient would have to flow back from one stage into another's value.

One process would carry the gradient of a value that an edit on a later stage used back into
the value's own stage; a pipeline does not (a copy received from another rank ends there; on
this rank, the earlier stage's backward would find its graph already used). So the backward of
each stage of this rank notes which of the values it might reach it reached, and a later stage's
backward reaching an earlier stage's value raises, on the rank that sees it.
"""

from __future__ import annotations

from ...interleave.points import add_tensor_hook


class ValueStages:
    """One trace's record of the values handed to its bodies, by stage."""

    def __init__(self):
        self.stages: dict = {}  # id(tensor) -> (tensor, stage) for the values handed to bodies
        # microbatch -> [(label, stages whose backward reached it, its stage)] for the values
        # an edit on another stage could use
        self.watched: dict = {}
        self.in_backward = None  # the stage of this rank whose backward action is running

    def note(self, value, stage: int) -> None:
        """``value`` was handed to a body as a value of ``stage``."""
        self.stages[id(value)] = (value, stage)

    def stage_of(self, tensor) -> int | None:
        """The stage whose value ``tensor`` is, or None: a tensor the body made."""
        entry = self.stages.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def watch(self, value, label: str, stage: int, microbatch: int) -> None:
        """Note which of this rank's stages' backward reaches ``value`` (of ``stage``)."""
        reached = []
        add_tensor_hook(value, lambda grad: reached.append(self.in_backward))
        self.watched.setdefault(microbatch, []).append((label, reached, stage))

    def check_reach(self, stage: int, microbatch: int) -> None:
        """After ``stage``'s backward of ``microbatch``: raise if it reached a value of another
        stage that an edit on it used (see the module text)."""
        for label, reached, owner in self.watched.get(microbatch, ()):
            if any(s is not None and s != owner for s in reached):
                raise NotImplementedError(
                    f"{label} (run by pipeline stage {owner}) was used in an edit on stage "
                    f"{stage}, so its gradient would have to flow back to stage {owner}, which "
                    f"a pipeline schedule does not do: stage {owner}'s gradients would differ "
                    f"from one process. Use {label}.detach() in the edit to treat it as a "
                    f"constant, or make the edit on the stage that runs it."
                )
