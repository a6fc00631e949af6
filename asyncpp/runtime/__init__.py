"""The multi-process pipeline runtime: stage processes, the engine loop, launch wiring."""
