"""nnsight's memory clean-up tests (weakref and gc: nothing of a trace kept alive) and the error
types its tests expect, ported to the tiny model of nnsight_port.py and the tiny GPT-2.

Values are checked against plain PyTorch on the same weights, fp32, atol 1e-6.
"""

import gc
import weakref

import pytest
import torch
from nnsight_port import assert_close, tiny, tiny_input

import distgrad


@pytest.fixture
def x():
    return tiny_input()


def _traced(x, body):
    """Build a tiny model, wrap it, run ``body(model, tracer)`` in a no-grad trace; return the
    weak references ``body`` hands back (everything else goes out of scope here)."""
    net = tiny()
    model = distgrad.wrap(net)
    with torch.no_grad():
        with model.trace(x) as tracer:
            refs = body(model, tracer)
    return refs


def test_model_freed_after_trace_and_delete(x):
    """test_memory_cleanup::TestModelCleanup::test_model_freed_after_trace_and_delete and
    ::test_layer_freed_after_model_delete"""

    def make():
        net = tiny()
        refs = [weakref.ref(net), weakref.ref(net.layer1), weakref.ref(net.layer2)]
        model = distgrad.wrap(net)
        with torch.no_grad():
            with model.trace(x):
                model.layer2.output.save()
        return refs

    refs = make()
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_model_freed_without_trace():
    """test_memory_cleanup::TestModelCleanup::test_model_freed_without_trace"""
    net = tiny()
    ref = weakref.ref(net)
    model = distgrad.wrap(net)
    del model, net
    gc.collect()
    assert ref() is None


def test_multiple_traces_no_accumulation(x):
    """test_memory_cleanup::TestModelCleanup::test_multiple_traces_no_accumulation"""
    net = tiny()
    model = distgrad.wrap(net)
    refs = []
    for _ in range(5):
        with torch.no_grad():
            with model.trace(x):
                out = model.layer2.output.save()
        assert_close(out, net(x).detach())
        refs.append(weakref.ref(out))
        del out
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_only_saved_objects_are_tensors(x):
    """test_memory_cleanup::TestUnsavedObjectCleanup::test_only_saved_objects_are_tensors"""
    net = tiny()
    model = distgrad.wrap(net)
    with torch.no_grad():
        with model.trace(x):
            unsaved = model.layer1.output
            saved = model.layer2.output.save()
    # deliberate difference: a name bound in the body stays the real tensor, saved or not
    assert isinstance(unsaved, torch.Tensor) and isinstance(saved, torch.Tensor)
    assert_close(unsaved, net.layer1(x).detach())


def test_unsaved_values_not_retained(x):
    """test_memory_cleanup::TestUnsavedObjectCleanup::test_unsaved_intermediate_not_retained and
    ::test_unsaved_clones_not_retained: what the body dropped dies with the trace."""

    def body(model, tracer):
        clone = model.layer1.output.clone()
        ref = weakref.ref(clone)
        del clone
        return [ref, weakref.ref(model.output.save())]

    refs = _traced(x, body)
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("count", [1, 2])
def test_saved_tensors_freed_on_delete(x, count):
    """test_memory_cleanup::TestSavedObjectCleanup::test_saved_tensor_freed_on_delete,
    ::test_multiple_saved_tensors_freed_independently and ::test_saved_tensor_in_list_freed"""

    def body(model, tracer):
        saved = [model.layer1.output.save(), model.layer2.output.save()][-count:]
        return [weakref.ref(t) for t in saved]

    refs = _traced(x, body)
    gc.collect()
    assert len(refs) == count and all(ref() is None for ref in refs)


@pytest.mark.parametrize("edit", [False, True])
def test_tracer_freed_after_trace(x, edit):
    """test_memory_cleanup::TestTracerCleanup::test_tracer_freed_after_trace,
    ::test_tracer_no_reference_to_saved_tensors and ::test_tracer_freed_with_modifications"""

    def body(model, tracer):
        if edit:
            model.layer1.output[:] = 0
        saved = model.layer2.output.save()
        return [weakref.ref(tracer), weakref.ref(saved)]

    refs = _traced(x, body)
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_multiple_tracers_freed(x):
    """test_memory_cleanup::TestTracerCleanup::test_multiple_tracers_freed"""

    def make():
        model = distgrad.wrap(tiny())
        refs = []
        with torch.no_grad():
            for _ in range(5):
                with model.trace(x) as tracer:
                    model.output.save()
                    refs.append(weakref.ref(tracer))
        return refs

    refs = make()
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_wrapper_freed_with_model(x):
    """test_memory_cleanup::TestInterleaverCleanup::test_interleaver_freed_with_wrapper, on the
    wrapper itself (distgrad has no interleaver object)."""

    def make():
        model = distgrad.wrap(tiny())
        ref = weakref.ref(model)
        with torch.no_grad():
            with model.trace(x):
                model.output.save()
        return ref

    ref = make()
    gc.collect()
    assert ref() is None


# --- error types nnsight's tests expect ------------------------------------------------------


def test_module_not_found_is_attribute_error(model_gpt2):
    """test_lm.py::test_source_operation_not_found's error type, for a module path."""
    with pytest.raises(AttributeError, match="no submodule or attribute 'my_func'"):
        with model_gpt2.trace("_"):
            model_gpt2.transformer.h[0].attn.my_func.output.save()


def test_index_out_of_range_is_index_error(model_gpt2):
    """nnsight's Envoy indexing (``h[5]`` of a 2-block model) raises IndexError."""
    with pytest.raises(IndexError, match="indices 0..1"):
        with model_gpt2.trace("_"):
            model_gpt2.transformer.h[5].output.save()


def test_out_of_order_inputs_is_out_of_order_error(model_gpt2):
    """test_lm.py::test_out_of_order (``.inputs`` of an earlier module after a later output)"""
    with pytest.raises(distgrad.OutOfOrderError):
        with model_gpt2.trace("_"):
            model_gpt2.transformer.h[1].output.save()
            model_gpt2.transformer.h[0].inputs.save()


def test_user_error_in_body_propagates(model_gpt2):
    """test_batching.py::TestCppBacktraceGuard::test_guard_on_surfaces_python_exception: a torch
    error in an invoke body, after it has read a value, is a plain RuntimeError."""
    with pytest.raises(RuntimeError, match="inconsistent tensor size"):
        with model_gpt2.trace() as tracer:
            with tracer.invoke("The Eiffel Tower is in the city of"):
                model_gpt2.transformer.h[1].output
                torch.ones(3) @ torch.ones(4)
            with tracer.invoke("The Colosseum is in the city of"):
                pass


@pytest.fixture
def model_gpt2(gpt2, tokenizer):
    return distgrad.wrap(gpt2, tokenizer=tokenizer)
