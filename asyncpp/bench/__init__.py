"""Benchmarks. Figures are reported as ratios against a baseline measured in the same run."""
