"""`python -m layertap.extract ARGS` (and `accelerate launch -m layertap.extract ARGS`) is
`layertap extract ARGS`."""

import sys

from layertap.cli import main

sys.exit(main(["extract", *sys.argv[1:]]))
