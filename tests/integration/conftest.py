"""Fixtures that start real components for the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .docker_engine import busybox_image, engine


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    gen = engine()
    client = next(gen)
    if client is None:
        pytest.skip("no Docker Engine, and none can be started here (needs root and docker.io)")
    yield client
    for _ in gen:  # stops a dockerd the fixture started
        pass


@pytest.fixture(scope="session")
def busybox(docker_client: Any) -> str:
    image = busybox_image(docker_client)
    if image is None:
        pytest.skip("busybox-static is not installed: no test image can be built")
    return image
