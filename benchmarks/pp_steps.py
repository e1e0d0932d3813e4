"""The three steps the pipeline benchmarks time (``pp_overhead.py`` on two ranks,
``pp_one_process.py`` on one): the same read and edit with raw hooks and with distgrad, and a
distgrad body that reads nothing."""
from __future__ import annotations


def pipeline_steps(model, net, x, y, step, owns_layer1: bool) -> dict:
    """``{name: step function}``. ``step()`` runs the schedule's step as raw hooks need it;
    ``owns_layer1``: whether this rank runs ``net.layers[1]`` (raw hooks act only there). The
    step: save layers[1]'s output and its gradient, and double that gradient."""
    def raw():
        kept = []

        def on_grad(grad):
            kept.append(grad.clone())
            return grad * 2

        def on_output(module, inputs, out):
            kept.append(out.detach())
            out.register_hook(on_grad)

        handle = net.layers[1].register_forward_hook(on_output) if owns_layer1 else None
        step()
        if handle is not None:
            handle.remove()
        return kept

    def traced():
        with model.trace(x, target=y) as tr:
            h = model.layers[1].output.save()
            with tr.loss.backward():
                g1 = h.grad.save()
                h.grad = h.grad * 2
        return h, g1

    def traced_empty():
        with model.trace(x, target=y) as tr:
            with tr.loss.backward():
                pass

    return {"raw hooks": raw, "distgrad": traced, "distgrad, a body that reads nothing": traced_empty}
