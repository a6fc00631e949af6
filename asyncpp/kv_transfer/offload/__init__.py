"""The offload connector: every stage saves its layers of full KV blocks into a host store and loads them back."""
