"""Each test starts with Dynamo's caches empty: tests define functions of one code object with
different shapes, and a recompile across tests would make Dynamo's shapes dynamic."""

from __future__ import annotations

import pytest
import torch._dynamo


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
