"""Shared fixtures of the integration tests: one preprocessed corpus cache for the session."""

import pytest


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """Directory where the built-in corpus is preprocessed once (SHARDWORK_CACHE)."""
    return str(tmp_path_factory.mktemp("corpus"))
