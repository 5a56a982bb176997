"""`python -m torchllama.train [options]` = `torchllama train [options]`; the entry point for
torchrun: `torchrun --nproc-per-node N -m torchllama.train --preset ... --data ... --out ...`."""

import sys

from torchllama.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
