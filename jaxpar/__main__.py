"""``python -m jaxpar`` runs the ``jaxpar`` command."""

import sys

from jaxpar.cli import main

sys.exit(main())
