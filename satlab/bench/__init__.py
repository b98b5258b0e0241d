"""Benchmarks: interleaved training throughput, memory and MFU per architecture; Lightning's overhead."""
