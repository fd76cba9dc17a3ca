"""Benchmark scripts: each compares fp8pass against a baseline measured in the same run."""
