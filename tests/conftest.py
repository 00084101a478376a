from __future__ import annotations

import pytest

from tests.factories import RecordingWriter


@pytest.fixture
def writer() -> RecordingWriter:
    return RecordingWriter()
