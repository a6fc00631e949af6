"""Prefill/decode disaggregation: a router in front of a prefill engine and a decode engine.

`config` reads a deployment's `[disagg]` table and derives each engine's
config; `deploy` starts both engines and the router (`python -m
asyncpp.launch --config configs/pd-1-1.toml`); `router` is the router itself
(`front`: its clients, `link`: its engines, `translate`: requests to the
engines and their errors back, `stats`: its counters); `child`
runs one engine as a child launcher. The KV itself moves between the engines
through their connector ("pd", `asyncpp.kv_transfer.pd`); the router only
passes the connector's opaque `kv_transfer_params` from one to the other.
"""
