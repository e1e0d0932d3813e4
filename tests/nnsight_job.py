"""nnsight 0.8.1 running one test module's programs, in a fresh process.

    python tests/nnsight_job.py MODULE OUT

Imports ``MODULE`` (a ``test_from_nnsight_*.py`` of this folder), calls its
``nnsight_numbers(nnsight)`` and writes what it returns (tensors, in lists and dicts) to
``OUT`` with ``torch.save``. nnsight is imported here only: in the test process it would mount
its ``save`` on every object and patch ``torch.Tensor`` for the tests that follow.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from pathlib import Path

import torch


def main(module: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    warnings.simplefilter("ignore")  # LanguageModel and the `with tracer.iter` form warn
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    import nnsight

    torch.save(detached(importlib.import_module(module).nnsight_numbers(nnsight)), out)


def detached(value):
    """Tensors detached (a saved activation is part of a graph), in the lists, tuples and dicts
    that hold them."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {key: detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [detached(item) for item in value]
    return value


if __name__ == "__main__":
    main(*sys.argv[1:])
