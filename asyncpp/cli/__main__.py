"""`python -m asyncpp.cli`: the `asyncpp` console script."""

import sys

from asyncpp.cli import main

sys.exit(main())
