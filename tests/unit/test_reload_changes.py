"""What a reload says it changed: each environment, RewardService and API quota by name,
with what changed in it (the list of RewardServices left said neither what went nor what
was edited)."""

from __future__ import annotations

import asyncio

from tangram.api.cluster import ApiSpec
from tangram.api.wire import EnvSpec
from tangram.service.changes import named_changes
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine


def test_each_name_added_removed_or_changed_with_its_fields() -> None:
    before = {"a": EnvConfig(spec=EnvSpec(name="a", image="i"))}
    after = {
        "a": EnvConfig(spec=EnvSpec(name="a", image="j"), max_command_s=30.0),
        "b": EnvConfig(spec=EnvSpec(name="b", image="i")),
    }
    assert named_changes("env", before, after) == [
        "env a changed (spec.image, max_command_s)",
        "env b added",
    ]
    assert named_changes("env", after, {}) == ["env a removed", "env b removed"]
    assert named_changes("env", after, after) == []


def test_a_reload_names_the_quotas_it_changed() -> None:
    async def scenario() -> list[str]:
        quotas = (ApiSpec(name="search", concurrency=1), ApiSpec(name="old", concurrency=1))
        engine = Engine(PoolConfig(apis=quotas))
        new = (ApiSpec(name="search", concurrency=8), ApiSpec(name="new", concurrency=2))
        return engine.reconfigure(PoolConfig(apis=new))

    assert asyncio.run(scenario()) == [
        "API quota new added",
        "API quota old removed",
        "API quota search changed (concurrency)",
    ]
