"""Shared fixtures for shardwork-models tests."""
