"""One tensor-parallel job: every case on a tiny Llama split by parallelize_module, one process
group. Usage: tp_job.py --layout {tp,sp,fsdp-tp} --out DIR (ranks from the environment).

* tp: Colwise/Rowwise projections over all ranks (2).
* sp: the same plus sequence parallelism (norms and the residual stream split on dim 1).
* fsdp-tp: a (dp, tp) = (2, 2) mesh on 4 ranks, fully_shard over dp after TP.

Oracle: the same model unsplit on one process with plain PyTorch hooks doing the same edits,
on the global batch (fp32, atol 1e-5).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import distgrad
from cases import close, expect_error, expect_failure_of_rank1, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_llama, parallelize_llama
from flow_tp import case_flow  # noqa: E402

torch.set_num_threads(1)
SCALE = 1e-3
SEQ = 8


def global_ids(rows: int):
    return torch.randint(0, 384, (rows, SEQ), generator=torch.Generator().manual_seed(5))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def oracle(ids, sequence: bool, dp: int):
    """One process: the edits of case_read_edit done with plain hooks."""
    net = build_llama()
    l0, l1 = net.model.layers[0], net.model.layers[1]
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            seen[name] = out.detach().clone()
        return hook

    def q_hook(mod, args, out):
        seen["q"] = out.detach().clone()

        def on_grad(g):
            seen["gq"] = g.detach().clone()
            return g * 2
        out.register_hook(on_grad)

    def up_hook(mod, args, out):
        out = out.clone()
        out[:, :, :4] = 0
        return out

    def gate_hook(mod, args, out):
        out = out * 1.5
        out.register_hook(lambda g: seen.__setitem__("gg", g.detach().clone()))
        return out

    def norm_hook(mod, args, out):
        seen["norm"] = out.detach().clone()
        out = out.clone()
        out[:, 0] = 0
        return out

    def layer_hook(mod, args, out):
        out = out[0] if isinstance(out, tuple) else out
        seen["h0"] = out.detach().clone()
        out.register_hook(lambda g: seen.__setitem__("gh0", g.detach().clone()))

    handles = [l0.self_attn.q_proj.register_forward_hook(q_hook),
               l0.self_attn.k_proj.register_forward_hook(keep("k")),
               l0.self_attn.o_proj.register_forward_pre_hook(
                   lambda m, a: seen.__setitem__("o_in", a[0].detach().clone())),
               l0.mlp.up_proj.register_forward_hook(up_hook),
               l1.mlp.gate_proj.register_forward_hook(gate_hook)]
    if sequence:
        handles += [l1.post_attention_layernorm.register_forward_hook(norm_hook),
                    l0.register_forward_hook(layer_hook)]
    out = net(ids)
    (out.logits.sum() * SCALE / dp).backward()
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    seen["logits"] = out.logits.detach()
    return seen


def case_read_edit(model, net, ctx):
    """Reads (output shard, DTensor input, opt-in local shard), an in-place edit, an
    assignment, gradient reads and a gradient edit, all against the unsplit model."""
    rank, dp, dp_rank, tp_rank, sequence = ctx
    ids = global_ids(2 * dp)
    local = ids[2 * dp_rank: 2 * dp_rank + 2]
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if sequence else {}
    with model.trace(local, **kwargs):
        l0, l1 = model.model.layers[0], model.model.layers[1]
        q = l0.self_attn.q_proj.output.save()
        k_local = l0.self_attn.k_proj.local.output.save(gather="none")
        o_in = l0.self_attn.o_proj.input.save()
        l0.mlp.up_proj.output[:, :, :4] = 0
        if sequence:
            h0 = l0.output  # a sequence shard that only tp_shards= makes known
            norm = l1.post_attention_layernorm.output
            saved_norm = norm.clone().save()
            norm[:, 0] = 0
        gate = l1.mlp.gate_proj.output * 1.5
        l1.mlp.gate_proj.output = gate
        logits = model.output.logits.save()
        with (model.output.logits.sum() * SCALE).backward():
            gg = gate.grad.save()
            if sequence:
                gh0 = h0.grad.save()
            gq = q.grad.save()
            q.grad = q.grad * 2
    ref = oracle(ids, sequence, dp)
    rows = slice(None) if dp_rank == 0 else slice(2 * dp_rank, 2 * dp_rank + 2)
    # where the data-parallel rank is 0 (global rank 0 among them) the saves are the global
    # batch, gathered over the dp group; elsewhere they are this rank's rows
    close(q, ref["q"][rows], "q_proj output (shard seen whole)")
    close(o_in, ref["o_in"][rows], "o_proj input (DTensor seen whole)")
    half = ref["k"].shape[-1] // 2
    close(k_local, ref["k"][2 * dp_rank: 2 * dp_rank + 2, :, tp_rank * half:(tp_rank + 1) * half],
          ".local shard")
    close(logits, ref["logits"][rows], "logits after the edits")
    close(gg, ref["gg"][rows] * dp, "gradient of an assigned replacement")
    close(gq, ref["gq"][rows] * dp, "gradient of a sharded output")
    if sequence:
        close(saved_norm, ref["norm"][rows], "SequenceParallel norm output (DTensor)")
        close(gh0, ref["gh0"][rows] * dp, "gradient of a declared sequence shard")
    for name, want in ref["params"].items():
        got = model
        for part in name.split("."):
            got = got[int(part)] if part.isdigit() else getattr(got, part)
        close(full(got.grad), want, f"gradient of {name}")
    # a parameter gradient assigned whole is stored as this rank's shard, ready for a step
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.grad = weight.grad * 0.5
    close(weight.grad, ref["params"]["model.layers.0.mlp.up_proj.weight"] * 0.5,
          "parameter gradient after assignment")
    real = weight.param
    if type(real.grad) is not type(real) or real.grad.placements != real.placements:
        raise AssertionError(f"assigned gradient stored as {type(real.grad).__name__}")
    torch.optim.SGD([real], lr=0.0).step()
    net.zero_grad(set_to_none=True)


def case_read_edit_thread(model, net, ctx):
    """The same with the backward in a worker thread (what CUDA forces): the gathers of the
    gradients run on the body's thread while autograd's thread waits in the hook."""
    distgrad.config.backward_mode = "thread"
    try:
        case_read_edit(model, net, ctx)
    finally:
        distgrad.config.backward_mode = "auto"


def case_killed(model, net, ctx):
    """Rank 1 dies (SIGKILL) between the forward reads and the backward: the others report a
    lost rank within the failure timeout and exit normally."""
    import signal
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}

    def run():
        with model.trace(global_ids(2), **kwargs):
            q = model.model.layers[0].self_attn.q_proj.output
            loss = model.output.logits.sum()
            if ctx[0] == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            with loss.backward():
                q.grad

    expect_error(run, distgrad.RankFailedError, "stopped answering", heard=False)


def _counting_collectives():
    """A dispatch mode that counts collectives as CommDebugMode does (the same op sets, DTensor
    ops left to desugar first), without its module tracker, which fails under transformers
    5.25's Llama (IndexError in _fw_set_module_hook, every layout, also on older commits)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _comm_mode as comm
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = (set(comm.c10d_collective_ops) | set(comm.NATIVE_TO_PY_MAPPING)
               | set(comm.NATIVE_TO_PY_MAPPING.values()))
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t == DTensor for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in self.ops:
                self.total += 1
            return out

    return Count()


def case_collectives(model, net, ctx):
    """Exactly one collective per value the body visits, none for `.local` or replicated
    values: the counts of a trace that reads nothing and of one that reads differ by exactly the
    visits. On the CPU that one collective also carries the ranks' agreement that they are at
    the same value (agreement.py: Agreement.gather)."""
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}
    ids = global_ids(2)
    agreement = model._engine.views.agreement

    def trace(body):
        with model.trace(ids, **kwargs):
            body()
            with (model.output.logits.sum() * SCALE).backward():
                pass
        net.zero_grad(set_to_none=True)

    def count(body):
        made = agreement.made
        with _counting_collectives() as comm:  # the model's collectives and distgrad's
            trace(body)
        return comm.total, agreement.made - made

    def reads():
        l0 = model.model.layers[0]
        l0.self_attn.q_proj.output                  # a local shard: one all-gather
        l0.self_attn.k_proj.local.output            # opted out: none
        l0.self_attn.o_proj.input                   # a DTensor: one all-gather
        l0.mlp.up_proj.output                       # one
        model.model.layers[1].output                # replicated (plain TP), or under sp a
                                                    # sequence shard not named in tp_shards: none

    trace(reads)  # the first visits may grow the gather's capacity (a second collective, once)
    (base, _), (visited, agreed) = count(lambda: None), count(reads)
    expected = 3
    if visited - base != expected or agreed != expected:
        raise AssertionError(f"{visited - base} collectives ({agreed} agreements) for "
                             f"{expected} sharded visits (a trace without reads made {base})")


def case_two_forms(model, net, ctx):
    """`.local.output` then `.output` of one call: this rank's shard and the whole value are two
    forms of one value, so the second raises."""
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}
    try:
        with model.trace(global_ids(2), **kwargs):
            model.model.layers[0].self_attn.q_proj.local.output
            model.model.layers[0].self_attn.q_proj.output
    except distgrad.TraceStateError as exc:
        if "two forms" not in str(exc):
            raise
        return
    raise AssertionError(".output then .local.output of one call did not raise")


def case_rank_dependent(model, net, ctx):
    """Only rank 0 reads a sharded value (`if rank == 0:`): rank 0 waits to gather it while rank
    1 waits in the model's next all-reduce. Rank 0 raises instead of waiting forever; rank 1
    hears of it when rank 0's process ends (its all-reduce breaks then)."""
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}

    def run():
        with model.trace(global_ids(2), **kwargs):
            if ctx[0] == 0:
                model.model.layers[0].self_attn.q_proj.output.save()
            model.output.logits.save()

    expect_error(run, distgrad.TraceStateError, "different values on different ranks")


def case_rank_dependent_value(model, net, ctx):
    """The ranks read different values of one shape at the same moment (k_proj on rank 0,
    v_proj on rank 1): the gather's header tells them apart, and every rank raises."""
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}

    def run():
        with model.trace(global_ids(2), **kwargs):
            attn = model.model.layers[0].self_attn
            (attn.k_proj if ctx[0] == 0 else attn.v_proj).output.save()

    expect_error(run, distgrad.TraceStateError, "different values on different ranks",
                 heard=False)


def case_failure(model, net, ctx):
    rank = ctx[0]
    ids = global_ids(2)

    def run():
        with model.trace(ids, **({"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {})):
            q = model.model.layers[0].self_attn.q_proj.output
            loss = model.output.logits.sum()
            if rank == 1:
                1 / 0
            with loss.backward():
                q.grad

    expect_failure_of_rank1(rank, run)


def build(layout: str):
    """The process group, the mesh, the split model and its wrap: (model, net, ctx)."""
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sequence = layout == "sp"
    if layout == "fsdp-tp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        net = parallelize_llama(build_llama(), mesh["tp"])
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        net = fully_shard(net, mesh=mesh["dp"])
        dp, dp_rank, tp_rank = 2, mesh.get_local_rank(0), mesh.get_local_rank(1)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        net = parallelize_llama(build_llama(), mesh, sequence_parallel=sequence)
        dp, dp_rank, tp_rank = 1, 0, rank
    model = distgrad.wrap(net, tp_shards={"model.layers.0": 1} if sequence else None)
    return model, net, (rank, dp, dp_rank, tp_rank, sequence)


def case_fails_in_body_on_rank1(model, net, ctx):
    """The harness's own check (tests/test_tensor_parallel.py names it; no layout test runs
    it): an assertion fails inside the body on rank 1, so distgrad destroys the process group
    on every rank. The cases after it must run on a fresh group and pass."""
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if ctx[4] else {}
    with model.trace(global_ids(2), **kwargs):
        model.model.layers[0].self_attn.q_proj.output.save()
        assert ctx[0] != 1, "deliberate failure on rank 1"
        model.output.logits.save()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", required=True, choices=["tp", "sp", "fsdp-tp"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="all", choices=["all", "killed", "rank_dependent",
                                                           "rank_dependent_value", "fails_first"])
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    # case_failure ends with an error on a rank, which tears the process group down: the
    # ranks start again for the cases after it (cases.run_cases)
    cases = {"all": (case_read_edit, case_read_edit_thread, case_collectives, case_flow,
                     case_failure, case_two_forms),
             "killed": (case_killed,), "rank_dependent": (case_rank_dependent,),
             "rank_dependent_value": (case_rank_dependent_value,),
             "fails_first": (case_fails_in_body_on_rank1, case_read_edit, case_collectives)}[args.cases]
    model, net, ctx = build(args.layout)
    run_cases(cases, args.out, ctx[0], model, net, ctx)


if __name__ == "__main__":
    sys.exit(main())
