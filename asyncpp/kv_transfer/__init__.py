"""KV connectors: moving KV blocks in and out of the paged cache, asynchronously, on every stage."""
