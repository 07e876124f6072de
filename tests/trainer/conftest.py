"""Fixtures of the trainer tests: a small prepared corpus shared by every end-to-end run of the session."""

import pytest

from data.config import DataConfig, ensure_prepared


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib-small"
    ensure_prepared(DataConfig(path=str(path), max_bytes=400_000, shard_size=16_384), progress=False)
    return path
