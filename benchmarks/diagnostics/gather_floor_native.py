"""Would C++ lower the gather's per-tensor floor? Rebinding S saved tensors to the rows of one
block, from Python (``unbind`` + ``tensor.data =``, what ``engines/ranks/gather.py`` does) and from
a C++ extension built here with ``torch.utils.cpp_extension.load_inline`` (``unbind`` below
autograd's view tracking + ``set_data``; needs a C++ compiler, builds in about 30 s).

    python benchmarks/diagnostics/gather_floor_native.py

Tensors of ddp_overhead.py's shape ([2, 8, 64] float32 per rank, 2 ranks), grad mode off, median
of 2000 calls each. See docs/performance.md (the DDP section) for what the numbers mean.
"""

from __future__ import annotations

import time

import torch
from gather_floor import median_us
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
void rebind_rows(std::vector<at::Tensor> targets, const at::Tensor& block) {
  at::AutoDispatchBelowADInplaceOrView below_view_tracking;
  auto rows = block.unbind(0);
  for (size_t i = 0; i < targets.size(); ++i) targets[i].set_data(rows[i]);
}
"""


def main() -> int:
    t0 = time.time()
    native = load_inline(
        "distgrad_gather_floor_probe", cpp_sources=SOURCE, functions=["rebind_rows"]
    )
    print(f"built and loaded in {time.time() - t0:.1f} s")
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print("| saved tensors S | Python us | C++ us |\n|---:|---:|---:|")
    for s in (1, 4, 16, 64):
        tensors = [torch.randn(2, 8, 64) for _ in range(s)]
        originals = [t.data for t in tensors]
        block = torch.empty(s, 4, 8, 64)

        def python(tensors, block):
            for tensor, value in zip(tensors, block.unbind(0)):
                tensor.data = value

        def cpp(tensors, block):
            native.rebind_rows(tensors, block)

        cpp(tensors, block)
        assert tensors[-1].shape == (4, 8, 64) and tensors[-1].data_ptr() == block[-1].data_ptr()
        for tensor, original in zip(tensors, originals):
            tensor.data = original
        print(
            f"| {s} | {median_us(python, tensors, block, originals, 2000):.1f} | "
            f"{median_us(cpp, tensors, block, originals, 2000):.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
