"""`python -m layertap ...` is the `layertap` command."""

import sys

from layertap.cli import main

sys.exit(main())
