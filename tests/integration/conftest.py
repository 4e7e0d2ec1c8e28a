"""Fixtures that start real components for the integration tests."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from tangram.node_agent.exec_server import Built, build

from .docker_engine import busybox_image
from .docker_engine import coding_image as import_coding_image


@pytest.fixture(scope="session")
def busybox(docker_client: Any) -> str:
    image = busybox_image(docker_client)
    if image is None:
        pytest.skip("busybox-static is not installed: no test image can be built")
    return image


@pytest.fixture(scope="session")
def coding_image(docker_client: Any, request: pytest.FixtureRequest) -> str:
    """The coding-environment image (python3, pytest, pytest-xdist; user ``agent``)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # Building takes minutes the first time: let its progress lines through.
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        image = import_coding_image(docker_client)
    if image is None:
        pytest.skip(
            "no coding image, and none can be built here: building it needs root and "
            "debootstrap (apt-get install debootstrap), or a cached root file system in "
            "$TANGRAM_CACHE_DIR (default /var/cache/tangram)"
        )
    return image


@pytest.fixture(scope="session")
def execd(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The exec server binary, built once per test session."""
    built = build(tmp_path_factory.mktemp("execd"))
    if built.path is None:
        pytest.skip(f"no exec server: {built.reason}")
    return built
