"""`python -m adaflash_hf.cli ...`: the `adaflash` command."""

import sys

from . import main

sys.exit(main())
