"""Fixtures of the outage tests: a fake vLLM server in its own process, for workers run as
processes (they take no job here, but start against a server that answers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.fake_vllm import FakeServerProcess


@pytest.fixture(scope="module")
def inference() -> Iterator[str]:
    fake = FakeServerProcess().start()
    yield fake.url
    fake.stop()
