"""Stage-side worker: the two-phase model runner."""
