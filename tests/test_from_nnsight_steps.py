"""``tracer.iter[...]`` and ``tracer.all()``: a body's loop over the steps of ``generate``, as
nnsight 0.8.1 spells it (``distgrad/steps.py``), beside ``.call(i)``.

Each program runs in distgrad and in nnsight itself (``nnsight.LanguageModel`` around the tiny
GPT-2 and Llama built afresh, in a fresh process: ``nnsight_job.py``), and the values are
checked against plain ``generate`` with
forward hooks recording every step, fp32, atol 1e-6. The loop that outruns generation ends as
nnsight ends it (a warning, the values of the steps made kept, the statements after the loop
not run); the errors nnsight raises are raised with the same builtin type.
"""

import importlib.util

import pytest
import torch
from conftest import ATOL, NETS, run_in_nnsight

import distgrad
from distgrad.demo.models import build_tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nnsight") is None, reason="nnsight is not installed"
)

IDS = torch.tensor([[40, 72, 101, 33, 8]])
GREEDY = dict(max_new_tokens=3, do_sample=False)


@pytest.fixture(params=["gpt2", "llama"])
def name(request):
    return request.param


@pytest.fixture
def net(name):
    return NETS[name]()


@pytest.fixture(scope="module")
def theirs():
    return run_in_nnsight(__name__)


def nnsight_numbers(nnsight) -> dict:
    """This module's programs run by nnsight (in ``nnsight_job.py``'s process), per model, and
    the builtin type of the errors it raises."""
    numbers = {}
    for name, build in NETS.items():
        model = nnsight.LanguageModel(build(), tokenizer=build_tokenizer())
        numbers[name] = {
            "range": _range(model, nnsight.save),
            "all": _every_step(model, nnsight.save),
            "chosen and pinned": _chosen_and_pinned(model, nnsight.save),
        }
    numbers["errors"] = [_builtin_error(model, program) for program in ERRORS]
    return numbers


def _head(model):
    return model.lm_head


def _block(model):
    return model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0]


def _plain_steps(net, ids=IDS):
    """Block 0's and the head's output at every step of plain generate."""
    blocks, heads = [], []
    handles = [
        _block(net).register_forward_hook(lambda m, a, out: blocks.append(out)),
        net.lm_head.register_forward_hook(lambda m, a, out: heads.append(out)),
    ]
    try:
        net.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **GREEDY)
    finally:
        for handle in handles:
            handle.remove()
    return blocks, heads


def _close(got, expected):
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _range(model, save):
    with model.generate(IDS, **GREEDY) as tracer:
        blocks, steps = save([]), save([])
        for step in tracer.iter[1:3]:
            steps.append(step)
            blocks.append(_block(model).output)
            _head(model).output  # noqa: B018 - a second module in the same step
    return steps, blocks


def test_a_range_of_steps(name, net, theirs):
    steps, blocks = _range(distgrad.wrap(net), distgrad.save)
    nn_steps, nn_blocks = theirs[name]["range"]
    plain, _ = _plain_steps(net)
    assert steps == nn_steps == [1, 2]
    for got, theirs, expected in zip(blocks, nn_blocks, plain[1:3]):
        _close(got, expected)
        _close(got, theirs)


def _every_step(model, save):
    with model.generate(IDS, **GREEDY) as tracer:
        heads = save([])
        for _ in tracer.all():
            heads.append(_head(model).output)
        after = save("reached")  # noqa: F841 - not reached: the loop ends the body
    return heads


def test_all_steps_end_the_body_with_a_warning(name, net, theirs):
    with pytest.warns(UserWarning, match="the loop asked for a step the run did not make"):
        heads = _every_step(distgrad.wrap(net), distgrad.save)
    nn_heads = theirs[name]["all"]
    _, plain = _plain_steps(net)
    assert len(heads) == len(nn_heads) == len(plain) == GREEDY["max_new_tokens"]
    for got, theirs, expected in zip(heads, nn_heads, plain):
        _close(got, expected)
        _close(got, theirs)


def test_statements_after_an_outrun_loop_do_not_run(gpt2):
    model = distgrad.wrap(gpt2)
    with pytest.warns(UserWarning, match="cut short"):
        with model.generate(IDS, **GREEDY) as tracer:
            for _ in tracer.iter[:10]:
                model.lm_head.output  # noqa: B018
            after = "reached"
    with pytest.raises(NameError):
        after  # noqa: B018


def _chosen_and_pinned(model, save):
    with model.generate(IDS, **GREEDY) as tracer:
        chosen = save([])
        for _ in tracer.iter[[0, 2]]:
            chosen.append(_head(model).output)
    with model.generate(IDS, **GREEDY) as tracer:
        with tracer.iter[1]:
            pinned = _block(model).output.save()
    return chosen, pinned


def test_a_list_of_steps_and_a_pinned_step(name, net, theirs):
    chosen, pinned = _chosen_and_pinned(distgrad.wrap(net), distgrad.save)
    nn_chosen, nn_pinned = theirs[name]["chosen and pinned"]
    blocks, heads = _plain_steps(net)
    for got, theirs, expected in zip(chosen, nn_chosen, [heads[0], heads[2]]):
        _close(got, expected)
        _close(got, theirs)
    _close(pinned, blocks[1])
    _close(pinned, nn_pinned)
    # the same value by .call(i)
    model = distgrad.wrap(net)
    with model.generate(IDS, **GREEDY):
        by_call = _block(model).call(1).output.save()
    _close(by_call, pinned)


def test_steps_in_invokes(gpt2, tokenizer):
    """Each invoke's loop reads its own rows at each step (a batch of two prompts)."""
    prompts = [[40, 72, 101, 33, 8], [99, 12]]
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.generate(**GREEDY) as tracer:
        with tracer.invoke(prompts[0]):
            first = distgrad.save([])
            for _ in tracer.iter[0:2]:
                first.append(model.lm_head.output[:, -1])
        with tracer.invoke(prompts[1]):
            second = distgrad.save([])
            for _ in tracer.iter[1:3]:
                second.append(model.transformer.h[0].output[:, -1])
                second.append(model.lm_head.output[:, -1])
    _, heads = _plain_steps(gpt2, torch.tensor([prompts[0]]))
    for got, expected in zip(first, heads[:2]):
        _close(got, expected[:, -1])
    blocks, heads = _plain_steps(gpt2, torch.tensor([prompts[1]]))
    expected = [x[:, -1] for step in (1, 2) for x in (blocks[step], heads[step])]
    assert len(second) == 4
    for got, want in zip(second, expected):
        _close(got, want)


def _next(model):
    with model.generate(IDS, **GREEDY) as tracer:
        tracer.next()


def _negative_step(model):
    with model.generate(IDS, **GREEDY) as tracer:
        for _ in tracer.iter[[-1]]:
            model.lm_head.output  # noqa: B018


ERRORS = [_next, _negative_step]


def _builtin_error(model, program) -> list:
    """The builtin classes the error ``program`` raises on ``model`` is."""
    try:
        program(model)
    except Exception as error:
        builtins = (AttributeError, ValueError, RuntimeError, TypeError, IndexError)
        return [c.__name__ for c in type(error).__mro__ if c in builtins]
    return []


def test_errors_where_nnsight_raises(gpt2, theirs):
    model = distgrad.wrap(gpt2)
    assert theirs["errors"] == [["AttributeError"], ["ValueError"]]
    for program, (nnsights,) in zip(ERRORS, theirs["errors"]):
        assert nnsights in _builtin_error(model, program), program.__name__
    with pytest.raises(AttributeError, match="for step in tracer.iter"):
        _next(model)
    with pytest.raises(distgrad.TraceUsageError, match="an int >= 0, got -1"):
        _negative_step(model)
    with pytest.raises(distgrad.TraceUsageError, match="a range of steps is a loop"):
        with model.generate(IDS, **GREEDY) as tracer:
            with tracer.iter[0:2]:
                pass
    with pytest.raises(distgrad.TraceUsageError, match="a stride is not served"):
        with model.generate(IDS, **GREEDY) as tracer:
            tracer.iter[0:4:2]
    with pytest.raises(distgrad.TraceUsageError, match="inside the body"):
        next(iter(model.generate(IDS).iter[0:1]))


def test_a_module_first_named_after_it_ran_in_the_step_raises(gpt2):
    """A module a loop names first counts its calls from the start of generation, but one
    named in a step after it ran there cannot: its call in step 1 would be counted as
    step 2's."""
    model = distgrad.wrap(gpt2)
    with pytest.raises(distgrad.OutOfOrderError, match="served in step 2"):
        with model.generate(IDS, **GREEDY) as tracer:
            model.lm_head.output  # noqa: B018 - step 0, after block 0 has run
            for _ in tracer.iter[1:2]:
                model.transformer.h[0].output  # noqa: B018


def test_an_invokes_loop_that_outruns_generation_ends_only_that_body(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.warns(UserWarning, match="cut short"):
        with model.generate(**GREEDY) as tracer:
            with tracer.invoke([40, 72, 101]):
                heads = distgrad.save([])
                for _ in tracer.all():
                    heads.append(model.lm_head.output[:, -1])
                after = distgrad.save("reached")  # noqa: F841 - not reached
            with tracer.invoke([99, 12]):
                ids = tracer.result.save()
    batch = torch.tensor([[40, 72, 101], [0, 99, 12]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    expected = gpt2.generate(batch, attention_mask=mask, pad_token_id=0, **GREEDY)
    assert torch.equal(ids, expected[1:])
    _, plain = _plain_steps(gpt2, torch.tensor([[40, 72, 101]]))
    assert len(heads) == len(plain) == GREEDY["max_new_tokens"]
    for got, want in zip(heads, plain):
        _close(got, want[:, -1])
    with pytest.raises(NameError):
        after  # noqa: B018


def test_edits_in_a_loop_over_steps_equal_those_by_call(gpt2):
    """The steering recipe (``examples/generate.py``) in nnsight's spelling: an edit of block
    0 at each step of a ``tracer.iter`` loop gives the ids of the same edits by ``.call(i)``,
    which differ from unsteered generate."""
    new = 4
    greedy = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    prompt = torch.randint(2, 384, (2, 6), generator=torch.Generator().manual_seed(0))
    steering = torch.randn(new, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    model = distgrad.wrap(gpt2)
    with model.generate(prompt, **greedy) as tracer:
        for step in range(new):
            block = model.transformer.h[0].call(step)
            block.output = block.output + steering[step]
        by_call = tracer.result.save()
    with model.generate(prompt, **greedy) as tracer:
        for step in tracer.iter[:new]:
            block = model.transformer.h[0]
            block.output = block.output + steering[step]
        by_loop = tracer.result.save()
    assert torch.equal(by_loop, by_call)
    assert not torch.equal(by_loop, gpt2.generate(prompt, **greedy))


def test_steps_under_a_wrapper_that_is_not_the_model(tmp_path):
    """Under DDP (one gloo rank) generate() calls the model inside the wrapper: the loop's
    steps are that model's calls, and the same check raises for a module named after it ran
    in the step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distgrad.demo.models import build_gpt2

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        net = build_gpt2()
        model = distgrad.wrap(DistributedDataParallel(net))
        blocks, heads = _plain_steps(net)
        with model.generate(IDS, **GREEDY) as tracer:
            got = distgrad.save([])
            for _ in tracer.iter[1:3]:
                got.append(model.transformer.h[0].output)
                got.append(model.lm_head.output)
        assert len(got) == 4
        for value, expected in zip(got, [blocks[1], heads[1], blocks[2], heads[2]]):
            _close(value, expected)
        with pytest.raises(distgrad.OutOfOrderError, match="served in step 2"):
            with model.generate(IDS, **GREEDY) as tracer:
                model.lm_head.output  # noqa: B018 - step 0, after block 0 has run
                for _ in tracer.iter[1:2]:
                    model.transformer.h[0].output  # noqa: B018
    finally:
        if dist.is_initialized():  # (an error under an engine may have ended the group)
            dist.destroy_process_group()
