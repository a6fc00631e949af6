"""Wire format: typed dataclass messages <-> msgpack. Nothing is ever unpickled."""
