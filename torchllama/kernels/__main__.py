"""`python -m torchllama.kernels`: build the kernels now (as `make setup` does) and say which
instruction set they use, or why torch's kernels will be used instead."""

import sys
import time

from torchllama import kernels

t0 = time.perf_counter()
if kernels.available():
    print(f"torchllama kernels: {kernels.isa()} ({kernels.build_dir()}, "
          f"{time.perf_counter() - t0:.1f} s)")
    for name, level in kernels.kernel_levels().items():
        print(f"  {name:15s} {level}")
else:
    print(f"torchllama kernels: unavailable ({kernels.unavailable_reason()}); "
          "quantized models use torch's kernels", file=sys.stderr)
