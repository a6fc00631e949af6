"""The engine: in-process `Engine` and output processing."""
