"""Paged KV cache: block manager with prefix caching and cache sizing."""
