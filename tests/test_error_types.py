"""Error types nnsight users catch: where nnsight 0.8.1 raises a builtin exception, distgrad's
error for the same mistake is also an instance of that builtin (and stays an instance of
distgrad's own class). nnsight's type for each case is noted beside it (checked by running
the same code under ``nnsight.LanguageModel``)."""

import pytest
import torch

import distgrad

X = torch.randn(2, 8)


def _raised(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_trace_usage_errors_are_value_errors(mlp):
    model = distgrad.wrap(mlp)

    def nested_invoke():  # nnsight: ValueError
        with model.trace() as tr:
            with tr.invoke(X):
                out = model.output.save()
                with tr.invoke(X):
                    inner = model.output.save()
        return out, inner

    def no_inputs():  # nnsight: ValueError
        with model.trace():
            pass

    def read_without_inputs():  # nnsight: ValueError
        with model.trace():
            model[0].output

    def inputs_and_invoke():  # nnsight: ValueError
        with model.trace(X) as tr:
            with tr.invoke(X):
                pass

    def read_outside_a_trace():  # nnsight: ValueError
        model[0].output

    def save_outside_a_trace():  # nnsight: ValueError
        distgrad.save(X)

    def read_beside_the_invokes():  # nnsight: ValueError
        with model.trace() as tr:
            with tr.invoke(X):
                pass
            model.output

    cases = {
        nested_invoke: "an invoke cannot be opened inside another invoke's body",
        no_inputs: "has no inputs",
        read_without_inputs: "has no inputs",
        inputs_and_invoke: "already has inputs",
        read_outside_a_trace: r"model\[0\].output can only",
        save_outside_a_trace: "called outside a trace",
        read_beside_the_invokes: "inside the `with tracer.invoke",
    }
    for fn, message in cases.items():
        error = _raised(fn)
        assert isinstance(error, ValueError), fn.__name__
        assert isinstance(error, distgrad.TraceStateError), fn.__name__  # as before
        assert isinstance(error, distgrad.TraceUsageError), fn.__name__
        with pytest.raises(ValueError, match=message):
            fn()


def test_nested_invoke_names_the_outer_invoke(mlp):
    model = distgrad.wrap(mlp)
    with pytest.raises(distgrad.TraceUsageError, match="inside the body of invoke 1"):
        with model.trace() as tr:
            with tr.invoke(X):
                pass
            with tr.invoke(X):
                with tr.invoke(X):
                    pass


@pytest.mark.usefixtures("backward_mode")
def test_gradient_errors_are_value_and_runtime_errors(mlp):
    # nnsight: RuntimeError from PyTorch's hook machinery for each
    model = distgrad.wrap(mlp)

    def wrong_shape():
        with model.trace(X):
            h = model[0].output
            with model.output.sum().backward():
                h.grad = torch.zeros(3)

    def wrong_dtype():
        with model.trace(X):
            h = model[0].output
            with model.output.sum().backward():
                h.grad = h.grad.double()

    def no_grad_flows():
        with model.trace(X):
            x = model[0].input
            with model.output.sum().backward():
                x.grad

    for fn, message in {
        wrong_shape: "shape",
        wrong_dtype: "dtype",
        no_grad_flows: "does not require grad",
    }.items():
        error = _raised(fn)
        assert isinstance(error, distgrad.GradientError), fn.__name__
        assert isinstance(error, ValueError) and isinstance(error, RuntimeError), fn.__name__
        assert message in str(error), fn.__name__


def test_an_index_past_the_end_is_also_an_attribute_error(gpt2):
    # nnsight: AttributeError
    model = distgrad.wrap(gpt2)
    for catch in (IndexError, AttributeError):
        with pytest.raises(catch, match=r"model.transformer.h\[7\] does not exist"):
            model.transformer.h[7]
