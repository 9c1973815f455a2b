"""`python -m ktserve ...`: the `ktserve` command."""

import sys

from ktserve.cli import main

sys.exit(main())
