"""Prefill/decode disaggregation: moving a prompt's KV from the engine that computed it to the one that decodes it."""
