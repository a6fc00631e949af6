"""Llama-family model code: single-device, built as a slice of layers."""
