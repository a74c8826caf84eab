"""`python -m graphpar` (and `torchrun ... -m graphpar train ...`): the graphpar command line."""

import sys

from graphpar.cli.main import main

sys.exit(main())
