"""Token ids of several invokes made one batch: padded to one length, with an attention mask.

An invoke may give its ids as a list of ints (one row), a list of lists (rows, which may be of
different lengths), a 1-D tensor (one row) or a 2-D tensor, positionally or as ``input_ids=``.
With a tokenizer, rows of different lengths are padded with its ``pad_token_id``, on the side
``pads_left`` chooses, and the attention mask says which positions are padding (an invoke's
own ``attention_mask`` is padded with zeros; one is made of ones where an invoke gave none).
The per-token fields beside the ids are padded with the value the model ignores there. A body
then sees its rows as padded, as the model ran them.

The layout is nnsight's ``LanguageModel``'s, so that a program written for it reads the same
numbers: a model that generates from a prompt (decoder-only) has its rows padded on the left,
whatever the tokenizer's ``padding_side``, so that ``[:, -1]`` is every prompt's last token;
and ``with_positions`` counts each left-padded row's ``position_ids`` from its first token, so
that each prompt's tokens sit at the positions they have when the prompt runs alone. Other
models are padded on the tokenizer's ``padding_side``.
"""

from __future__ import annotations

import functools
import inspect
import numbers

import torch

# what each per-token field is padded with (None: the tokenizer's pad id)
ROW_FIELDS = {
    "input_ids": None,
    "attention_mask": 0,
    "token_type_ids": 0,
    "position_ids": 0,
    "labels": -100,
}


def is_ids(value) -> bool:
    """Token ids: an integer tensor of one or two dimensions, or (nested) lists of ints."""
    if isinstance(value, torch.Tensor):
        return (
            value.dim() in (1, 2)
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype is not torch.bool
        )
    if isinstance(value, (list, tuple)) and value:
        first = value[0]
        if isinstance(first, (list, tuple)):
            return all(
                isinstance(row, (list, tuple)) and row and all(_is_int(t) for t in row)
                for row in value
            )
        return all(_is_int(t) for t in value)
    return False


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def ids_slot(args: tuple, kwargs: dict, tokenizer):
    """Where an invoke's token ids are: ``"input_ids"``, ``0`` (the first positional
    argument, read as ids only when the model has a tokenizer) or None."""
    if "input_ids" in kwargs:
        return "input_ids"
    if args and tokenizer is not None and is_ids(args[0]):
        return 0
    return None


def _rows(value) -> list[torch.Tensor]:
    """Each row of ids (or of a per-token field) as a 1-D tensor."""
    if isinstance(value, torch.Tensor):
        return list(value) if value.dim() == 2 else [value]
    if value and isinstance(value[0], (list, tuple)):
        return [torch.tensor(row) for row in value]
    return [torch.tensor(value)]


def pads_left(module, tokenizer) -> bool:
    """Whether the rows distgrad pads for ``module`` go on the left: always for a decoder-only
    model that generates (as nnsight's ``LanguageModel`` sets its tokenizer), else where the
    tokenizer pads."""
    return is_decoder(module) or getattr(tokenizer, "padding_side", "right") == "left"


def is_decoder(module) -> bool:
    """A model that continues a prompt: ``can_generate()`` and not an encoder-decoder."""
    can_generate = getattr(module, "can_generate", None)
    config = getattr(module, "config", None)
    return (
        callable(can_generate)
        and bool(can_generate())
        and not getattr(config, "is_encoder_decoder", False)
    )


def with_positions(args: tuple, kwargs: dict, module) -> dict:
    """``kwargs`` with ``position_ids`` counted from each left-padded row's first token, where
    the batch has left-padded rows, gives no positions of its own and ``module`` takes them."""
    mask = kwargs.get("attention_mask")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (
        "position_ids" in kwargs
        or not isinstance(mask, torch.Tensor)
        or not isinstance(ids, torch.Tensor)
        or mask.dim() != 2
        or mask.shape != ids.shape[:2]
        or bool(mask.all())
        or not _takes_positions(type(module))
    ):
        return kwargs
    positions = _positions(mask)
    if bool((positions == torch.arange(mask.shape[1], device=mask.device)).all()):
        return kwargs  # no row is left-padded: the model counts them so itself
    return {**kwargs, "position_ids": positions}


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """A row that is padding then tokens counts from its first token; any other row (not
    padded, padded on the right, or masked with a gap) from its first position, as the model
    would count it."""
    mask = mask.long()
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    left_padded = (mask.diff(dim=-1) >= 0).all(-1, keepdim=True)
    return torch.where(left_padded, counted, plain)


@functools.cache
def _takes_positions(cls) -> bool:
    try:
        return "position_ids" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # a forward with no signature to read
        return False


def pad_invokes(
    prepared: list[tuple[tuple, dict]], tokenizer, left: bool
) -> list[tuple[tuple, dict]]:
    """The invokes' (args, kwargs) with their token ids made 2-D tensors of one length.

    Unchanged where no invoke gives ids. Ids given positionally by some invokes and as
    ``input_ids=`` by others are all passed as ``input_ids=``."""
    slots = [ids_slot(a, k, tokenizer) for a, k in prepared]
    if all(s is None for s in slots) or any(s is None for s in slots):
        return prepared  # nothing to pad, or a mix the batch join refuses by name
    keyword = len(set(slots)) > 1
    per_invoke = []  # (args, kwargs, {field: [1-D rows]})
    for (args, kwargs), slot in zip(prepared, slots):
        args, kwargs = tuple(args), dict(kwargs)
        ids = args[0] if slot == 0 else kwargs["input_ids"]
        if slot == 0:
            args = args[1:]
        fields = {"input_ids": _rows(ids)}
        lengths = [len(row) for row in fields["input_ids"]]
        for key in ROW_FIELDS:
            value = kwargs.get(key)
            if key == "input_ids" or not (isinstance(value, (list, tuple)) or is_ids(value)):
                continue
            rows = _rows(value)
            if [len(row) for row in rows] == lengths:  # one value per token: padded with them
                fields[key] = rows
                del kwargs[key]
            elif key == "attention_mask":
                raise ValueError(
                    f"invoke inputs: the attention_mask has rows of lengths "
                    f"{[len(r) for r in rows]} for token ids of lengths {lengths}."
                )
        per_invoke.append((args, kwargs, fields, slot))
    lengths = {len(row) for *_, fields, _ in per_invoke for row in fields["input_ids"]}
    masked = any("attention_mask" in fields for *_, fields, _ in per_invoke)
    pad_id = None
    if len(lengths) > 1:
        pad_id = getattr(tokenizer, "pad_token_id", None)
        if pad_id is None:
            raise ValueError(_no_pad_message(tokenizer, sorted(lengths)))
    width = max(lengths)
    out = []
    for args, kwargs, fields, slot in per_invoke:
        if (len(lengths) > 1 or masked) and "attention_mask" not in fields:
            fields["attention_mask"] = [
                torch.ones(len(r), dtype=torch.long) for r in fields["input_ids"]
            ]
        for key, rows in fields.items():
            value = pad_id if ROW_FIELDS[key] is None else ROW_FIELDS[key]
            kwargs[key] = torch.stack([_pad(r, width, value, left) for r in rows])
        ids = kwargs.pop("input_ids")
        if slot == 0 and not keyword:
            args = (ids, *args)
        else:
            kwargs = {"input_ids": ids, **kwargs}
        out.append((args, kwargs))
    return out


def _pad(row: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    missing = width - len(row)
    if missing == 0:
        return row
    fill = torch.full((missing,), value, dtype=row.dtype, device=row.device)
    return torch.cat([fill, row] if left else [row, fill])


def _no_pad_message(tokenizer, lengths: list[int]) -> str:
    if tokenizer is None:
        return (
            f"invoke inputs cannot be batched: token ids of lengths {lengths}, and "
            f"distgrad.wrap() was given no tokenizer to pad them with. Call "
            f"distgrad.wrap(module, tokenizer=...) or pad them to one length yourself "
            f"(with an attention_mask)."
        )
    return (
        f"invoke inputs cannot be batched: token ids of lengths {lengths}, and the "
        f"tokenizer has no pad token. Set one (tokenizer.pad_token = tokenizer.eos_token) "
        f"or pad them to one length yourself (with an attention_mask)."
    )
