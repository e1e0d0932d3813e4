"""One case of tests/test_other_libraries.py, in a fresh process (the import order is the point).

    python tests/other_libraries_job.py CASE ORDER

ORDER says which library patches ``torch.Tensor`` first: ``other-first`` or ``distgrad-first``.
The other library is nnsight (cases ``nnsight_*``) or a small library written here that puts
its own ``save``, ``grad`` and ``backward`` on ``torch.Tensor`` (cases ``library_*``). Each case
compares against plain autograd (forward hooks, retain_grad, tensor hooks) and prints OK.
"""

from __future__ import annotations

import sys

import torch

ATOL = 1e-6  # values handed over unchanged
PARAM_ATOL = 1e-5  # parameter gradients


def close(got, want, atol=ATOL):
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


# -- the libraries, imported in the order asked for -------------------------------------------
def import_nnsight(order):
    if order == "other-first":  # importing nnsight replaces Tensor.backward and mounts .save()
        import nnsight

        import distgrad
    else:
        import nnsight

        import distgrad
    return distgrad, nnsight


CALLS: list = []  # what the small library below was asked for


def install_library():
    """A library with its own ``Tensor.save``, ``grad`` property and ``backward`` wrapper,
    each recording its calls. Put over whatever torch.Tensor has (it does not defer to it)."""
    plain_grad = torch._C.TensorBase.__dict__["grad"]
    plain_backward = torch.Tensor.backward

    def save(self):
        CALLS.append("save")
        return self

    def get_grad(tensor):
        CALLS.append("grad")
        return plain_grad.__get__(tensor, type(tensor))

    def backward(self, *args, **kwargs):
        CALLS.append("backward")
        return plain_backward(self, *args, **kwargs)

    torch.Tensor.save = save
    torch.Tensor.grad = property(get_grad, plain_grad.__set__, plain_grad.__delete__)
    torch.Tensor.backward = backward


def import_library(order):
    if order == "other-first":
        install_library()
        import distgrad
    else:
        import distgrad

        install_library()
    return distgrad


# -- models and the plain-autograd oracle -----------------------------------------------------
def gpt2():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=300)).eval()
    return net, torch.randint(0, 300, (2, 8))


def oracle(net, ids, scale_h1=1.0):
    """Outputs of h[0] and h[1], their gradients (h[1]'s scaled by ``scale_h1`` as it flows on)
    and the parameter gradients, from forward hooks and tensor hooks on a plain backward."""
    acts, grads, handles = {}, {}, []

    def keep(i):
        def hook(module, args, out):
            acts[i] = out.detach().clone()

            def on_grad(g):
                grads[i] = g.clone()
                return g * scale_h1 if i == 1 else g

            out.register_hook(on_grad)

        return hook

    for i in range(2):
        handles.append(net.transformer.h[i].register_forward_hook(keep(i)))
    try:
        net.zero_grad(set_to_none=True)
        logits = net(ids).logits
        torch.autograd.backward(logits.sum())
    finally:
        for handle in handles:
            handle.remove()
    params = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return acts, grads, logits.detach(), params


def check_params(net, params):
    for name, p in net.named_parameters():
        close(p.grad, params[name], PARAM_ATOL)
    net.zero_grad(set_to_none=True)


def edit_step(model, net, ids):
    """The README program in either library: h[1]'s gradient read, then doubled; h[0]'s read."""
    net.zero_grad(set_to_none=True)
    with model.trace(ids):
        a0 = model.transformer.h[0].output
        a1 = model.transformer.h[1].output
        out0 = a0.save()
        loss = model.output.logits.sum()
        with loss.backward():
            g1 = a1.grad.save()
            a1.grad = a1.grad * 2
            g0 = a0.grad.save()
    return out0, g1, g0


def check_edit_step(model, net, ids, want):
    acts, grads, _, params = want
    out0, g1, g0 = edit_step(model, net, ids)
    close(out0, acts[0])
    close(g1, grads[1])
    close(g0, grads[0])  # h[0]'s gradient with h[1]'s doubled upstream of it
    check_params(net, params)


# -- the cases --------------------------------------------------------------------------------
def nnsight_save(order):
    """``.save()`` of outputs in nnsight's trace gives nnsight's values, before and after a
    distgrad trace of the same model; distgrad's own saves are unaffected."""
    distgrad, nnsight = import_nnsight(order)
    net, ids = gpt2()
    acts, _, logits, _ = oracle(net, ids)
    nn_model, dg_model = nnsight.NNsight(net), distgrad.wrap(net)
    for model in (nn_model, dg_model, nn_model):
        with torch.no_grad(), model.trace(ids):
            h0 = model.transformer.h[0].output.save()
            out = model.output.logits.save()
        close(h0, acts[0])
        close(out, logits)


def nnsight_backward(order):
    """nnsight's ``with loss.backward():`` (a ``.grad`` read, saved; an edit) gives plain
    autograd's numbers, and so does distgrad's, taking turns in one process."""
    distgrad, nnsight = import_nnsight(order)
    net, ids = gpt2()
    want = oracle(net, ids, scale_h1=2.0)
    nn_model, dg_model = nnsight.NNsight(net), distgrad.wrap(net)
    for model in (nn_model, dg_model, nn_model, dg_model):
        check_edit_step(model, net, ids, want)
    # nnsight has replaced Tensor.backward by now; distgrad's trace still opens its own block
    # (nnsight's would give the same numbers here, but not a parallel engine's backward)
    with dg_model.trace(ids):
        with dg_model.output.logits.sum().backward() as block:
            assert isinstance(block, distgrad.BackwardTracer), block
    net.zero_grad(set_to_none=True)


def nnsight_outside(order):
    """Outside any trace, a tensor's ``.save()`` is nnsight's (its own error), and a plain
    ``loss.backward()`` and ``.grad`` are PyTorch's."""
    distgrad, nnsight = import_nnsight(order)
    net, ids = gpt2()
    with nnsight.NNsight(net).trace(ids):  # nnsight has now patched what it patches
        nnsight.save(net.transformer.h[0])
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    close(x.grad, 2 * torch.ones(3))
    try:
        x.save()
    except distgrad.TraceStateError:
        raise AssertionError("distgrad's error, though nnsight has a .save() of its own") from None
    except ValueError as exc:
        assert "outside a trace" in str(exc), exc
    else:
        raise AssertionError("nnsight's .save() outside a trace raised nothing")


def library_numbers(order):
    """A library's own ``save``, ``grad`` and ``backward`` on torch.Tensor, put there before or
    after distgrad: distgrad's traces give plain autograd's numbers and never call the
    library's ``save``; every call outside a distgrad body is the library's."""
    distgrad = import_library(order)
    net, ids = gpt2()
    want = oracle(net, ids, scale_h1=2.0)
    model = distgrad.wrap(net)
    for _ in range(2):
        del CALLS[:]
        check_edit_step(model, net, ids, want)
        assert "save" not in CALLS, CALLS
    del CALLS[:]
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    close(x.grad, 2 * torch.ones(3))
    assert x.save() is x
    assert CALLS == ["backward", "grad", "save"], CALLS


CASES = {f.__name__: f for f in (nnsight_save, nnsight_backward, nnsight_outside, library_numbers)}

if __name__ == "__main__":
    torch.set_num_threads(1)
    CASES[sys.argv[1]](sys.argv[2])
    print("OK")
