"""Data parallelism: N replicas of one engine behind one router (`parallel.dp_size = N`).

`config` derives each replica's config from the deployment's; `deploy`
starts the replicas (child launchers, each on CPUs of its own when there are
enough) and the router (`python -m asyncpp.launch` hands it a config with
`parallel.dp_size` > 1); `router` sends each request to the replica where
its first token comes soonest (`placement`) and relays its deltas; `stats`
merges the replicas' stats into one engine's. The router is built from the
prefill/decode router's parts (`asyncpp.disagg`: the client front, the
engine links, the child launcher).
"""
