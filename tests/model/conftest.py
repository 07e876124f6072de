import pytest

from tests.helpers import build_tiny


@pytest.fixture
def tiny():
    return build_tiny()
