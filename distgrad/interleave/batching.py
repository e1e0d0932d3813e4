"""Inputs in, rows out: tokenizing, joining invoke inputs into one batch, and slicing values
per invoke.

An invoke owns a contiguous range of rows (``slice``) of the batch. ``narrow`` shows a value to one
invoke; ``merge`` puts the invokes' replacements back together. Only tensors whose first dimension
is the batch size are split; anything else is shown whole.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch

from . import token_ids


def _is_text(x) -> bool:
    return isinstance(x, str) or (
        isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(s, str) for s in x)
    )


def prepare(
    args: tuple, kwargs: dict, tokenizer, module, positions: bool = True
) -> tuple[tuple, dict]:
    """Tokenize a leading str / list[str]; pass tensors and dicts through. Texts of different
    lengths are padded as ``token_ids`` lays rows out for ``module`` (a ``padding_side=``
    keyword beside them wins), with their ``position_ids`` unless ``positions`` is false (an
    invoke's rows, padded again with the others before positions are counted)."""
    if args and _is_text(args[0]):
        if tokenizer is None:
            raise TypeError(
                "model.trace() got text but distgrad.wrap() was given no tokenizer: "
                "call distgrad.wrap(module, tokenizer=...) or pass token ids."
            )
        texts = [args[0]] if isinstance(args[0], str) else list(args[0])
        options, kwargs = tokenizer_options(tokenizer, kwargs)
        side = "left" if token_ids.pads_left(module, tokenizer) else "right"
        options = {"return_tensors": "pt", "padding": True, "padding_side": side, **options}
        encoded = _tokenize(tokenizer, texts, options)
        if positions and options.get("padding_side") == "left":
            encoded = token_ids.with_positions((), encoded, module)
        return args[1:], {**encoded, **kwargs}
    if args and isinstance(args[0], Mapping) and not kwargs and len(args) == 1:
        return (), dict(args[0])  # a BatchEncoding or a dict of model inputs
    return tuple(args), dict(kwargs)


def _tokenize(tokenizer, texts: list, options: dict) -> dict:
    """``tokenizer(texts, **options)``; a tokenizer whose call takes no ``padding_side`` pads
    on its ``padding_side`` attribute, set for this call only."""
    if "padding_side" in _call_parameters(type(tokenizer)):
        return dict(tokenizer(texts, **options))
    options = dict(options)
    side = options.pop("padding_side")
    own = getattr(tokenizer, "padding_side", None)
    if own is None:
        return dict(tokenizer(texts, **options))
    tokenizer.padding_side = side
    try:
        return dict(tokenizer(texts, **options))
    finally:
        tokenizer.padding_side = own


def tokenizer_options(tokenizer, kwargs: dict) -> tuple[dict, dict]:
    """Split the keywords given beside text into the tokenizer's (``truncation``,
    ``add_special_tokens``, ``padding``, ...: the named parameters of its ``__call__``) and the
    rest, which go to the model's call. ``max_length`` is also an option of ``generate``: it
    goes to the tokenizer only beside ``truncation`` or ``padding="max_length"``, which
    bound the text's length with it."""
    named = set(_call_parameters(type(tokenizer))) - _NOT_OPTIONS
    sizing = kwargs.get("truncation") or kwargs.get("padding") == "max_length"
    if not sizing:
        named.discard("max_length")
    options = {k: v for k, v in kwargs.items() if k in named}
    return options, {k: v for k, v in kwargs.items() if k not in options}


@functools.cache
def _call_parameters(cls) -> tuple:
    return tuple(inspect.signature(cls.__call__).parameters)


_NOT_OPTIONS = {
    "self",
    "text",
    "text_pair",
    "text_target",
    "text_pair_target",
    "kwargs",
    "tokenizer_kwargs",
    "return_tensors",
}


def batch_size(args: tuple, kwargs: dict) -> int:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError(
        "distgrad could not find a batched tensor (one with a batch dimension) in the trace inputs."
    )


def is_input(key: str, value) -> bool:
    """Whether a keyword argument of ``model.trace``/``generate`` is a model input (a per-row
    field of ``token_ids.ROW_FIELDS``, ``inputs_embeds``, or any tensor with a batch
    dimension) rather than an option of the call (``max_new_tokens=3``,
    ``output_hidden_states=True``, a ``GenerationConfig``)."""
    return (
        key in token_ids.ROW_FIELDS
        or key == "inputs_embeds"
        or (isinstance(value, torch.Tensor) and value.dim() > 0)
        or (isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()))
    )


def call_options(kwargs: dict) -> dict:
    """The keyword arguments that are options of the call, not inputs (see ``is_input``)."""
    return {k: v for k, v in kwargs.items() if not is_input(k, v)}


def join(inputs: list[tuple[tuple, dict]], tokenizer, module) -> tuple[tuple, dict, list[slice]]:
    """One batch from several invokes' raw inputs; returns the rows each invoke owns.

    Text is tokenized together; token ids of different lengths are padded
    (``token_ids.pad_invokes``), both laid out for ``module`` as ``token_ids`` says; anything
    else must already have one shape."""
    if all(a and _is_text(a[0]) for a, _ in inputs):
        texts, rows = [], []
        for a, _ in inputs:
            part = [a[0]] if isinstance(a[0], str) else list(a[0])
            rows.append(slice(len(texts), len(texts) + len(part)))
            texts.extend(part)
        kwargs = _same_options([k for _, k in inputs])
        args, kwargs = prepare((texts,), kwargs, tokenizer, module)
        return args, kwargs, rows
    left = token_ids.pads_left(module, tokenizer)
    prepared = [prepare(a, k, tokenizer, module, positions=False) for a, k in inputs]
    prepared = token_ids.pad_invokes(prepared, tokenizer, left)
    rows, start = [], 0
    for i, (a, k) in enumerate(prepared):
        try:
            n = batch_size(a, k)
        except ValueError:
            raise ValueError(
                f"invoke {i} has no batched tensor in its inputs (args {_kinds(a)}, "
                f"keywords {_kinds(k)}): give it tensors with a batch dimension"
                f"{', text or token ids' if tokenizer is not None else ''}."
            ) from None
        rows.append(slice(start, start + n))
        start += n
    counts = {len(a) for a, _ in prepared}
    if len(counts) > 1:
        raise ValueError(
            f"invoke inputs cannot be batched: the invokes give "
            f"{sorted(counts)} positional arguments; give each the same ones."
        )
    keys = [list(k) for _, k in prepared]
    for i, k in enumerate(keys[1:], 1):
        if set(k) != set(keys[0]):
            raise ValueError(
                f"invoke inputs cannot be batched: invoke 0 passes keywords "
                f"{sorted(keys[0])} and invoke {i} {sorted(k)}; give each the same "
                f"ones."
            )
    args = tuple(
        _cat([p[0][i] for p in prepared], f"argument {i}") for i in range(len(prepared[0][0]))
    )
    kwargs = {key: _cat([p[1][key] for p in prepared], f"keyword {key!r}") for key in keys[0]}
    if left:
        kwargs = token_ids.with_positions(args, kwargs, module)
    return args, kwargs, rows


def _kinds(values) -> str:
    items = values.items() if isinstance(values, dict) else enumerate(values)
    return "{" + ", ".join(f"{k}: {type(v).__name__}" for k, v in items) + "}"


def _same_options(kwargs_list: list[dict]) -> dict:
    """The keyword arguments of text invokes, which must agree: one call runs them all."""
    first = kwargs_list[0]
    for i, other in enumerate(kwargs_list[1:], 1):
        if other.keys() != first.keys() or any(not same(first[k], other[k]) for k in first):
            raise ValueError(
                f"invoke inputs cannot be batched: invoke 0 passes keywords "
                f"{sorted(first)} and invoke {i} {sorted(other)}, which differ; "
                f"one call runs them all, so give each the same ones."
            )
    return dict(first)


def same(a, b) -> bool:
    """Whether two option values are the same (tensors: the same object or equal values)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool((a == b).all())
        )
    try:
        return bool(a == b)
    except Exception:  # a value with no plain equality
        return False


def _cat(values: list, what: str):
    if isinstance(values[0], torch.Tensor):
        try:
            return torch.cat(values, dim=0)
        except RuntimeError as exc:
            hint = "pad them to one length"
            if token_ids.is_ids(values[0]):
                hint = (
                    "distgrad pads token ids given as input_ids=, or positionally with a "
                    "tokenizer (distgrad.wrap(module, tokenizer=...)); else pad them to one "
                    "length"
                )
            raise ValueError(
                f"invoke inputs cannot be batched: {what} has shapes "
                f"{[list(v.shape) for v in values]}; {hint}."
            ) from exc
    if any(not same(v, values[0]) for v in values[1:]):
        raise ValueError(
            f"invoke inputs cannot be batched: {what} differs between invokes "
            f"(one call runs them all)."
        )
    return values[0]


def narrow(value, rows: slice | None, size: int, slices: dict | None = None):
    """The part of a value that belongs to ``rows`` of a batch of ``size``.

    Each tensor view made is recorded in ``slices`` (id -> (view, full, rows)) so that a later
    ``view.grad`` can be served from the gradient of the full tensor."""
    if rows is None:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != size:
            return value
        view = value[rows]
        if slices is not None:
            slices[id(view)] = (view, value, rows)
        return view
    if isinstance(value, tuple):
        parts = [narrow(v, rows, size, slices) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    if isinstance(value, list):
        return [narrow(v, rows, size, slices) for v in value]
    if isinstance(value, Mapping):
        items = {k: narrow(v, rows, size, slices) for k, v in value.items()}
        return items if type(value) is dict else type(value)(**items)
    return value


def merge(full, pieces: list[tuple[slice, object]], size: int):
    """``full`` with each invoke's replacement put back into its rows; None if nothing changed."""
    pieces = [(r, p) for r, p in pieces if p is not None]
    if not pieces:
        return None
    if isinstance(full, torch.Tensor):
        if full.dim() == 0 or full.shape[0] != size:
            return pieces[-1][1]  # not batched: the last invoke's write wins
        parts, at = [], 0
        for rows, piece in sorted(pieces, key=lambda rp: rp[0].start):
            if rows.start > at:
                parts.append(full[at : rows.start])
            parts.append(piece)
            at = rows.stop
        if at < size:
            parts.append(full[at:])
        return torch.cat(parts, dim=0)
    if isinstance(full, (tuple, list)):
        merged = [merge(f, [(r, p[i]) for r, p in pieces], size) for i, f in enumerate(full)]
        items = [m if m is not None else f for m, f in zip(merged, full)]
        if isinstance(full, list):
            return items
        return type(full)(*items) if hasattr(full, "_fields") else type(full)(items)
    if isinstance(full, Mapping):
        items = {}
        for k, f in full.items():
            m = merge(f, [(r, p[k]) for r, p in pieces if k in p], size)
            items[k] = m if m is not None else f
        return items if type(full) is dict else type(full)(**items)
    return pieces[-1][1]


def with_call_options(kwargs: dict, options: dict) -> dict:
    """The joined inputs with the trace's call options (``model.generate(max_new_tokens=3)``
    beside invokes); an option an invoke also passes must agree."""
    for key, value in options.items():
        if key in kwargs and not same(kwargs[key], value):
            raise ValueError(
                f"{key}= is passed to model.trace()/generate() and, differently, "
                f"to the invokes; one call runs them all: pass it once."
            )
    return {**kwargs, **options}


def check_rows_kept(kwargs: dict, module) -> None:
    """generate() with several beams or returned sequences runs more rows than the invokes
    gave: each invoke's rows of its values could not be told apart."""
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    for name in ("num_beams", "num_return_sequences"):
        n = kwargs.get(name, getattr(config, name, None)) or 1
        if n > 1:
            raise NotImplementedError(
                f"model.generate(..., {name}={n}) with invokes: generate runs {n} rows per "
                f"input row, so an invoke's rows of its values are not its inputs' rows. Pass "
                f"the batch to model.generate(inputs, {name}={n}) without invokes."
            )
