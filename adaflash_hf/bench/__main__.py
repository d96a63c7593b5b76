"""`python -m adaflash_hf.bench ...`: the same as `adaflash bench ...`."""

import sys

from .cli_args import main

sys.exit(main())
