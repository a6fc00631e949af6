"""Speculative decoding: proposers that draft tokens on the last stage, the rejection sampler that
verifies them, and the policy that drafts only where it pays (`[speculative]` in the config)."""
