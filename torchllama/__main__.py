"""`python -m torchllama` = the `torchllama` command."""

import sys

from torchllama.cli import main

sys.exit(main())
