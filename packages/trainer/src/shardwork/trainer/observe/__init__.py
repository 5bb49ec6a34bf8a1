"""Observability: metrics files, progress display, throughput/MFU/memory, plots."""
