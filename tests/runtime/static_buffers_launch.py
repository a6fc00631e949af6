"""`python -m tests.runtime.static_buffers_launch`: the launcher with CPU stages on the static-buffer path.

CUDA stages run decode steps from static, padded buffers (the CUDA-graph
path); on CPU the launcher gives stages no graph sizes, so the launched
runtime never used them. Here every stage gets `SIZES`: decode steps are
padded into static buffers exactly as on CUDA, without capture.
"""

from __future__ import annotations

import sys

import asyncpp.launch

SIZES = (1, 2, 4, 8)

if __name__ == "__main__":
    asyncpp.launch.step_graph_sizes = lambda config, device: SIZES
    sys.exit(asyncpp.launch.main())
