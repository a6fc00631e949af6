"""`python -m asyncpp.bench`: the online serving benchmark (see `asyncpp.bench.serve`)."""

import sys

from asyncpp.bench.serve import main

sys.exit(main())
