"""``python -m jaxpar.train ...`` is ``jaxpar train ...``."""

import sys

from jaxpar.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
