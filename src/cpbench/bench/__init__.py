"""Benchmark machinery: FLOPs, timing, memory, environment capture, the driver."""
