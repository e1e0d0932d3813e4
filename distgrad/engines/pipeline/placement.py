"""Which rank runs which pipeline stage, and the action of its own at which a rank takes a value
of another rank's stage.

A value of a module another stage runs is the real value, sent by its owner: every rank runs
the same body, so the owner serves the same request and sends what it got to every other rank.
The receiver takes it only at an action of its own that the owner's sending certainly came
before, which makes waiting safe in every schedule:

* a forward value of an earlier stage: at the start of the forward of the microbatch on this
  rank's first stage after it (which needed the earlier stage's output, so its hooks had fired);
* a forward value or gradient of a later stage: at the start of the backward of the microbatch
  on this rank's last stage before it (which needed the later stage's gradient);
* a gradient of a stage after all of this rank's: when this rank's step has ended (``"end"``).

An action is named as torch.distributed.pipelining's ``_Action`` names it, ``(phase, stage,
microbatch)``, ``phase`` its computation type ("F" forward, "B" backward). Everything one rank
sends another for one receiving action travels together, as one *bundle* (``messages.py``),
named by that action or ``"end"``. With the round-robin placement of interleaved and looped
schedules each rank has one stage between any two of another rank's, so a bundle has one sending
stage, and between neighbouring stages it rides on the schedule's own message (piggybacked:
``piggyback_to``, ``piggyback_from``).
"""

from __future__ import annotations


class Placement:
    """The stages on the job's ranks, as every rank learned them from one all_gather, and the
    receiving action of each value (fixed by the placement, so kept across traces).

    ``can_piggyback``: rank -> whether its schedule's messages can carry bundles; a link between
    neighbouring stages carries them when both of its ranks can, so both ends agree."""

    def __init__(self, rank: int, stages_of_rank: dict, num_stages: int, can_piggyback: dict):
        self.rank = rank
        self.stages_of_rank = stages_of_rank  # rank -> its stages, in order
        self.rank_of_stage = {s: r for r, stages in stages_of_rank.items() for s in stages}
        self.my_stages = tuple(stages_of_rank[rank])
        self.other_ranks = [(r, stages) for r, stages in stages_of_rank.items() if r != rank]
        self.num_stages = num_stages
        self.last_stage = num_stages - 1
        # per stage of this rank, the neighbour's rank whose schedule messages with that stage
        # carry bundles: the next stage's (activations out, gradients in), the previous one's
        self.piggyback_to: dict = {}
        self.piggyback_from: dict = {}
        for stage in self.my_stages:
            for other, links in ((stage + 1, self.piggyback_to), (stage - 1, self.piggyback_from)):
                peer = self.rank_of_stage.get(other)
                if peer is not None and can_piggyback[rank] and can_piggyback[peer]:
                    links[stage] = peer
        self._receiving: dict = {}  # (stage, microbatch, forward) -> this rank's action
        self._sending: dict = {}  # (microbatch, forward, stage) -> {rank: its action}

    def refusal(self) -> str | None:
        """Why distgrad cannot run this placement of stages on ranks, or None. Every rank holds
        the same table, so every rank refuses alike."""
        stages_of_rank, num_stages = self.stages_of_rank, self.num_stages
        world = len(stages_of_rank)
        counts = {len(s) for s in stages_of_rank.values()}
        if len(counts) > 1:
            return (
                f"distgrad.wrap: distgrad runs pipelines with the same number of stages on "
                f"every rank: {num_stages} stages on {world} ranks, placed {stages_of_rank} "
                f"(rank: its stages)."
            )
        if counts.pop() * world != num_stages:
            return (
                f"distgrad.wrap: distgrad runs one pipeline over all the job's ranks, each "
                f"stage on one rank; here {world} ranks run {num_stages} stages, placed "
                f"{stages_of_rank} (rank: its stages). Pipelines replicated for data "
                f"parallelism are not supported."
            )
        for rank, stages in stages_of_rank.items():
            if any(b == a + 1 for a, b in zip(stages, stages[1:])):
                return (
                    f"distgrad.wrap: stages {stages} run on rank {rank}, two of them "
                    f"neighbours (a V-shaped schedule); distgrad supports schedules whose "
                    f"neighbouring stages are on different ranks (GPipe, 1F1B, "
                    f"Interleaved1F1B, LoopedBFS)."
                )
        if num_stages > world and any(
            r != s % world for r, stages in stages_of_rank.items() for s in stages
        ):
            return (
                f"distgrad.wrap: with several stages per rank distgrad needs them placed "
                f"round robin (stage s on rank s % {world}, as ScheduleInterleaved1F1B and "
                f"ScheduleLoopedBFS do), so that one rank's stage lies between any two of "
                f"another's; here: {stages_of_rank} (rank: its stages)."
            )
        return None

    def receive_action(self, stage: int, microbatch: int, forward: bool):
        """The action of this rank at which it takes a forward value (or a gradient) of another
        rank's ``stage``: the bundle the value comes in."""
        action = self._receiving.get((stage, microbatch, forward))
        if action is None:
            action = self._receiving[(stage, microbatch, forward)] = receiving_action(
                self.my_stages, stage, microbatch, forward
            )
        return action

    def send_actions(self, microbatch: int, forward: bool, stage: int) -> dict:
        """``{rank: its receiving action}`` for a forward value (or gradient) of this rank's
        ``stage``: the bundle it goes in, for every other rank."""
        actions = self._sending.get((microbatch, forward, stage))
        if actions is None:  # the same for every value of this microbatch, direction and stage
            actions = self._sending[(microbatch, forward, stage)] = {
                rank: receiving_action(stages, stage, microbatch, forward)
                for rank, stages in self.other_ranks
            }
        return actions


def receiving_action(stages, stage: int, microbatch: int, forward: bool):
    """The action at which a rank running ``stages`` takes a forward value (or a gradient) of
    another rank's ``stage``: the first of its own at which the owner has certainly sent it (see
    the module text). A forward value: the forward of its first stage after ``stage`` (which
    needed ``stage``'s output), else the backward of its last stage before it (which needed the
    later stages' gradients). A gradient: the backward of its last stage before ``stage``, else
    when its step has ended."""
    if forward:
        later = [s for s in stages if s > stage]
        if later:
            return ("F", later[0], microbatch)
    earlier = [s for s in stages if s < stage]
    return ("B", earlier[-1], microbatch) if earlier else "end"
