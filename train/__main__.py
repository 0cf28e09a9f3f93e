"""`python -m layertap.train ARGS` (and `accelerate launch -m layertap.train ARGS`) is
`layertap train ARGS`."""

import sys

from layertap.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
