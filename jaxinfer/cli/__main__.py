"""`python -m jaxinfer.cli`: the `jaxinfer` command."""

import sys

from jaxinfer.cli import main

sys.exit(main())
