"""`python -m graphpar.cli`: the graphpar command line."""

import sys

from graphpar.cli.main import main

sys.exit(main())
