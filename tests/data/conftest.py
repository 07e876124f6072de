"""Fixtures shared by the data tests."""

import pytest

from tests.data.synthetic import write_text_corpus


@pytest.fixture
def text_corpus(tmp_path):
    texts = write_text_corpus(tmp_path / "corpus")
    return tmp_path / "corpus", texts
