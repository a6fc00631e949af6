"""Small C kernels for CPU hot spots, compiled on first use (see `build`), each with a torch fallback."""
