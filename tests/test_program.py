"""The issue's main program, on the tiny GPT-2, against plain autograd."""

import torch
from conftest import ATOL, TEXT, assert_param_grads, param_grads, reference

import distgrad


def test_main_program_matches_autograd(gpt2, tokenizer, backward_mode):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    got = {n: p.grad.clone() for n, p in gpt2.named_parameters()}

    enc = dict(tokenizer([TEXT], return_tensors="pt", padding=True))
    _, ref_grad, doubled = reference(gpt2, enc, gpt2.transformer.h[0], edit=lambda g: g * 2)
    _, _, plain = reference(gpt2, enc, gpt2.transformer.h[0])
    torch.testing.assert_close(g, ref_grad, atol=ATOL, rtol=0)
    gpt2.zero_grad(set_to_none=True)
    for n, p in gpt2.named_parameters():
        p.grad = got[n]
    assert_param_grads(gpt2, doubled)
    # Downstream of h[0] (h[1], ln_f, and the tied lm_head/wte's output-side use) is unchanged,
    # upstream (h[0] and wpe) is changed.
    for name in doubled:
        same = torch.allclose(got[name], plain[name], atol=1e-5)
        if name.startswith(("transformer.h.1.", "transformer.ln_f.")):
            assert same, name
        if name.startswith(("transformer.h.0.", "transformer.wpe.")):
            assert not same, name


def test_llama_and_mlp_gradients(llama, mlp, tokenizer, backward_mode):
    model = distgrad.wrap(llama, tokenizer=tokenizer)
    with model.trace(TEXT):
        h = model.model.layers[1].output
        loss = model.output.logits.pow(2).mean()
        with loss.backward():
            g = h.grad.save()
            h.grad = torch.zeros_like(h.grad)
    enc = dict(tokenizer([TEXT], return_tensors="pt", padding=True))
    got = {n: p.grad.clone() for n, p in llama.named_parameters() if p.grad is not None}
    _, ref_grad, ref = reference(
        llama, enc, llama.model.layers[1], edit=torch.zeros_like, loss_fn=lambda x: x.pow(2).mean()
    )
    torch.testing.assert_close(g, ref_grad, atol=ATOL, rtol=0)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)
    assert float(got["model.layers.0.mlp.up_proj.weight"].abs().sum()) == 0.0

    x = torch.randn(5, 8)
    net = distgrad.wrap(mlp)
    with net.trace(x):
        h2 = net[2].output.save()
        out = net.output
        with out.sum().backward():
            g2 = h2.grad.save()
    got = param_grads(mlp)
    ref_out, ref_grad, ref = reference(mlp, x, mlp[2])
    torch.testing.assert_close(h2, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(g2, ref_grad, atol=ATOL, rtol=0)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)
