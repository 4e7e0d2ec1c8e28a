"""The tangram.dev/v1alpha1 custom resources and the YAML loader of embedded mode."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from tangram.api.demand import AmdahlEfficiency, ChoicesDemand, RangeDemand
from tangram.api.documents import Document, ResourceError, Resources, parse_documents
from tangram.api.resources import (
    API_VERSION,
    GROUP,
    PLURALS,
    SHORT_NAMES,
    VERSION,
    ActionPool,
    ActionPoolSpec,
    CpuPool,
    Resource,
    RewardService,
    SecretRef,
    TrajectoryEnv,
)
from tangram.cli.manifests import load_documents

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "manifests" / "examples"


def pool(name: str = "p", namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    return _object("ActionPool", name, namespace, spec or {"cpu": {}})


def env(name: str = "e", namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    return _object("TrajectoryEnv", name, namespace, {"poolRef": "p", "image": "img", **spec})


def service(name: str = "s", namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    base = {"poolRef": "p", "entrypoint": "pkg.mod:fn", "weights": "/w", "gpuMemoryGiB": 10}
    return _object("RewardService", name, namespace, {**base, **spec})


def _object(kind: str, name: str, namespace: str | None, spec: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": spec}


def parse(*docs: object) -> Resources:
    return parse_documents(Document("test.yaml", i, d) for i, d in enumerate(docs, 1))


def problems(*docs: object) -> list[str]:
    with pytest.raises(ResourceError) as e:
        parse(*docs)
    assert str(e.value) == "\n".join(e.value.problems)
    return e.value.problems


# --- the examples ----------------------------------------------------------------------------


def _example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_there_are_the_four_examples() -> None:
    names = {p.parent.name for p in _example_files()}
    assert names >= {"local", "coding", "deepsearch", "mopd"}


@pytest.mark.parametrize("path", _example_files(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_loads_with_consistent_references(path: Path) -> None:
    resources = load_documents([path])
    assert len(resources) > 0
    assert resources.check_references() == []


def test_all_examples_load_together() -> None:
    resources = load_documents(sorted(p for p in EXAMPLES.iterdir() if p.is_dir()))
    assert resources.check_references() == []
    assert len(resources.pools) == 5


def test_local_example_is_what_embedded_mode_serves() -> None:
    resources = load_documents([EXAMPLES / "local"])
    local = resources.pools[("default", "local")].spec
    assert local.cpu is not None and local.cpu.idle_cores == 1
    assert local.gpu is None
    (search,) = local.apis
    assert (search.name, search.concurrency, search.rate, search.period_seconds) == (
        "search",
        4,
        10,
        1.0,
    )
    assert search.endpoint is None
    sandbox = resources.envs[("default", "sandbox")]
    assert sandbox.pool_key() == ("default", "local")
    assert sandbox.spec.image == "tangram-local/busybox:1"
    shell, tests = sandbox.spec.actions
    assert (shell.name, shell.cpu, shell.command) == ("shell", 1, [])
    assert tests.command == ["sh", "-c", "echo running on {dop} cores"]
    assert tests.cpu == RangeDemand(min=1, max=2)
    assert tests.efficiency == AmdahlEfficiency(amdahl=0.9)
    assert tests.t1_seconds == 1.0


def test_coding_example_has_an_elastic_pytest_profile() -> None:
    resources = load_documents([EXAMPLES / "coding" / "pool.yaml"])
    coding = resources.pools[("rl", "coding")].spec
    assert coding.cpu is not None and coding.cpu.cores_per_node == 60
    assert coding.cpu.node_selector
    swe = resources.envs[("rl", "swe")].spec
    assert swe.warm_pool == 8
    pytest_profile = next(a for a in swe.actions if a.name == "pytest")
    assert pytest_profile.command == ["pytest", "-n", "{dop}", "-q"]
    assert pytest_profile.cpu == RangeDemand(min=1, max=32)
    assert pytest_profile.efficiency == AmdahlEfficiency(amdahl=0.93)
    assert pytest_profile.t1_seconds == 95


def test_deepsearch_example_keeps_its_secret_and_resolves_the_keys() -> None:
    resources = load_documents([EXAMPLES / "deepsearch"])
    assert [(d["kind"], d["metadata"]["name"]) for d in resources.other] == [
        ("Secret", "search-api-keys")
    ]
    apis = resources.pools[("rl", "deepsearch")].spec.apis
    assert [a.name for a in apis] == ["search", "browse"]
    for api in apis:
        assert api.endpoint is not None and api.endpoint.startswith("https://")
        assert api.secret_ref is not None
        assert resources.secret_value("rl", api.secret_ref)


def test_mopd_example_has_three_services_sharing_the_gpus() -> None:
    resources = load_documents([EXAMPLES / "mopd"])
    gpu = resources.pools[("rl", "mopd")].spec.gpu
    assert gpu is not None and gpu.gpus_per_node == 8
    services = {key[1]: s.spec for key, s in resources.services.items()}
    assert len(services) == 3
    assert len({tuple(s.dop_choices) for s in services.values()}) == 3
    assert len({s.gpu_memory_gib for s in services.values()}) == 3
    assert any(p.input_size is not None for s in services.values() for p in s.profiles)
    # Each names a build() returning (module, score), as docs/gpu.md declares one: the
    # judge named its score, which the worker would have called as the build.
    documented = (ROOT / "docs" / "gpu.md").read_text()
    assert "entrypoint: rewards.judge:build" in documented
    assert "def build():\n    return MyRewardModel(), score" in documented
    assert {s.entrypoint.partition(":")[2] for s in services.values()} == {"build"}


# --- defaults and Python use ---------------------------------------------------------------


def test_defaults() -> None:
    res = parse(pool(), env(), service(gpuMemoryGiB=1.5), pool("g", gpu={}))
    p = res.pools[("default", "p")]
    assert p.metadata.namespace == "default" and p.metadata.generation is None
    assert p.spec.cpu == CpuPool(idle_cores=1, cores_per_node=None, node_selector={})
    assert p.spec.apis == []
    sched = p.spec.scheduling
    assert (sched.ordering, sched.depth, sched.max_candidates, sched.elastic) == (
        "fcfs",
        2,
        None,
        True,
    )
    assert (p.spec.scheduler.replicas, p.spec.scheduler.port, p.spec.scheduler.resources) == (
        1,
        8080,
        {},
    )
    assert (p.spec.admission.max_queued, p.spec.admission.max_request_bytes) == (100000, 1048576)
    assert p.spec.access.namespaces == [] and p.spec.access.service_accounts == []
    g = res.pools[("default", "g")].spec.gpu
    assert g is not None and g.gpus_per_node is None
    e = res.envs[("default", "e")].spec
    assert e.memory_gib == 1.0 and e.disk_gib is None
    assert e.cpu == RangeDemand(min=1, max=1)
    assert (e.workdir, e.network, e.env, e.setup, e.actions) == ("/work", "none", {}, [], [])
    assert (e.security.read_only_root, e.security.user, e.security.pids_limit) == (
        False,
        None,
        512,
    )
    assert (e.warm_pool, e.idle_timeout_seconds) == (0, None)
    s = res.services[("default", "s")].spec
    assert (s.dop_choices, s.profiles, s.max_batch, s.restore_seconds) == ([1], [], 16, None)
    assert s.gpu_memory_gib == 1.5


def test_defaults_are_not_shared_between_objects() -> None:
    a, b = ActionPoolSpec(cpu=CpuPool()), ActionPoolSpec(cpu=CpuPool())
    assert a.apis == b.apis
    assert a.apis is not b.apis


def test_python_code_uses_snake_case_names() -> None:
    spec = ActionPoolSpec(cpu=CpuPool(cores_per_node=8, idle_cores=2))
    assert spec.model_dump(by_alias=True)["cpu"] == {
        "nodeSelector": {},
        "coresPerNode": 8,
        "idleCores": 2,
    }


def test_profile_without_cpu_uses_the_environment_default() -> None:
    doc = env(cpu={"choices": [1, 2, 4]}, actions=[{"name": "run", "efficiency": {"amdahl": 1}}])
    spec = parse(doc).envs[("default", "e")].spec
    assert spec.profile_cpu(spec.actions[0]) == ChoicesDemand(choices=[1, 2, 4])


def test_resource_union_dispatches_on_kind() -> None:
    adapter: TypeAdapter[Resource] = TypeAdapter(Resource)
    assert isinstance(adapter.validate_python(pool()), ActionPool)
    assert isinstance(adapter.validate_python(env()), TrajectoryEnv)
    assert isinstance(adapter.validate_python(service()), RewardService)


def test_names_of_the_api_group() -> None:
    assert (GROUP, VERSION, API_VERSION) == ("tangram.dev", "v1alpha1", "tangram.dev/v1alpha1")
    assert SHORT_NAMES == {"ActionPool": "ap", "TrajectoryEnv": "tenv", "RewardService": "rsvc"}
    assert PLURALS == {
        "ActionPool": "actionpools",
        "TrajectoryEnv": "trajectoryenvs",
        "RewardService": "rewardservices",
    }


# --- validation errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "path", "words"),
    [
        (pool(apis=[{"name": "q"}]), "spec.apis[0]", "concurrency, rate or both"),
        (
            pool(apis=[{"name": "q", "concurrency": 1, "burst": 5}]),
            "spec.apis[0].burst",
            "only a rate has a burst",
        ),
        (
            pool(apis=[{"name": "q", "rate": 1}, {"name": "q", "concurrency": 1}]),
            "spec.apis",
            "duplicate API names ['q']",
        ),
        (pool(apis=[{"name": "Q!", "rate": 1}]), "spec.apis[0].name", "pattern"),
        (pool(apis=[{"name": "q", "rate": 0}]), "spec.apis[0].rate", "greater than or equal"),
        (
            pool(apis=[{"name": "q", "rate": 1, "periodSeconds": 0}]),
            "spec.apis[0].periodSeconds",
            "greater than 0",
        ),
        (
            pool(apis=[{"name": "q", "rate": 1, "periodSeconds": float("inf")}]),
            "spec.apis[0].periodSeconds",
            "finite",
        ),
        (
            pool(apis=[{"name": "q", "rate": 1, "endpoint": "ftp://x.example"}]),
            "spec.apis[0].endpoint",
            "pattern",
        ),
        (
            pool(apis=[{"name": "q", "rate": 1, "endpoint": "https://"}]),
            "spec.apis[0].endpoint",
            "not an http(s) URL",
        ),
        (
            pool(apis=[{"name": "q", "rate": 1, "secretRef": {"name": "s"}}]),
            "spec.apis[0].secretRef.key",
            "Field required",
        ),
        (pool(scheduling={}), "spec", "a pool needs cpu, gpu or apis"),
        (pool(cpu={"idleCores": 0}), "spec.cpu.idleCores", "greater than or equal to 1"),
        (pool(gpu={"gpusPerNode": 3}), "spec.gpu.gpusPerNode", "Input should be 1, 2, 4 or 8"),
        (pool(cpu={}, scheduling={"depth": 5}), "spec.scheduling.depth", "less than or equal"),
        (pool(cpu={}, scheduling={"ordering": "lifo"}), "spec.scheduling.ordering", "'fcfs'"),
        (pool(cpu={}, scheduler={"replicas": 2}), "spec.scheduler.replicas", "less than or equal"),
        (
            pool(cpu={}, scheduler={"resources": {"request": {"cpu": "1"}}}),
            "spec.scheduler.resources",
            "only requests and limits",
        ),
        (
            pool(cpu={}, scheduler={"resources": {"limits": {"memory": "1 Gi"}}}),
            "spec.scheduler.resources.limits.memory",
            "not a quantity",
        ),
        (
            pool(
                cpu={},
                scheduler={"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}},
            ),
            "spec.scheduler.resources.requests.cpu",
            "'2' is more than limits.cpu ('1500m')",
        ),
        (
            pool(cpu={}, scheduler={"resources": {"limits": {"gpu": "1"}}}),
            "spec.scheduler.resources.limits.gpu",
            "'gpu' is not a resource",
        ),
        (
            pool(cpu={"nodeSelector": {"pool": "rl workers"}}),
            "spec.cpu.nodeSelector.pool",
            "'rl workers': at most 63",
        ),
        (
            pool(gpu={"nodeSelector": {"Example.com/gpu": "a100"}}),
            "spec.gpu.nodeSelector",
            "the part before '/' must be a DNS subdomain",
        ),
        (pool(cpu={}, access={"namespaces": ["Team A"]}), "spec.access.namespaces", "Team A"),
        (
            pool(cpu={}, access={"serviceAccounts": ["worker"]}),
            "spec.access.serviceAccounts",
            "namespace/name",
        ),
        (
            pool(cpu={}, access={"tenants": [{"name": "a"}, {"name": "a", "weight": 2}]}),
            "spec.access.tenants",
            "listed more than once: ['a']",
        ),
        (
            pool(cpu={}, access={"tenants": [{"name": "a", "maxShare": 1.5}]}),
            "spec.access.tenants[0].maxShare",
            "less than or equal to 1",
        ),
        (pool(name="My_Pool"), "metadata.name", "pattern"),
        (env(poolRef="a/b/c"), "spec.poolRef", "pattern"),
        (env(memoryGiB=0), "spec.memoryGiB", "greater than 0"),
        (env(diskGiB=0), "spec.diskGiB", "greater than 0"),
        (env(diskGiB="2Gi"), "spec.diskGiB", "valid number"),
        (env(cpu=0), "spec.cpu", "at least one core"),
        (env(cpu={"min": 3, "max": 1}), "spec.cpu", "min (3) is greater than max (1)"),
        (env(workdir="work"), "spec.workdir", "pattern"),
        (env(env={"1BAD": "x", "GOOD": "y"}), "spec.env", "not environment variable names"),
        (env(env={"TRAILING\n": "x"}), "spec.env", "not environment variable names"),
        (env(setup=[["true"], []]), "spec.setup[1]", "at least 1 item"),
        (env(security={"pidsLimit": 8}), "spec.security.pidsLimit", "greater than or equal"),
        (env(warmPool=-1), "spec.warmPool", "greater than or equal to 0"),
        (
            env(actions=[{"name": "a"}, {"name": "a"}]),
            "spec.actions",
            "duplicate action profile names ['a']",
        ),
        (
            env(actions=[{"name": "a", "efficiency": {"amdahl": 0.9}}]),
            "spec.actions[0].efficiency",
            "given, but cpu allows only one core count",
        ),
        (
            env(actions=[{"name": "a", "cpu": {"min": 1, "max": 4}, "efficiency": {"amdahl": 2}}]),
            "spec.actions[0].efficiency.amdahl",
            "less than or equal to 1",
        ),
        (env(actions=[{"name": "a", "t1Seconds": 0}]), "spec.actions[0].t1Seconds", "than 0"),
        (env(maxCommandSeconds=0), "spec.maxCommandSeconds", "greater than 0"),
        (
            env(maxCommandSeconds=60, actions=[{"name": "a"}, {"name": "b", "timeoutSeconds": 90}]),
            "spec.actions[1].timeoutSeconds",
            "90 s is over maxCommandSeconds (60 s)",
        ),
        (
            env(actions=[{"name": "a", "cpu": {"choices": [0, 2]}}]),
            "spec.actions[0].cpu",
            "one core",
        ),
        (env(workdir="/work/../.tangram/bin"), "spec.workdir", "holds the exec server"),
        (env(workdir="/.tangram"), "spec.workdir", "holds the exec server"),
        (env(workdir="//.tangram/run"), "spec.workdir", "holds the exec server"),
        (env(workdir="//", security={"readOnlyRoot": True}), "spec.workdir", "below it"),
        (env(workdir="/", security={"readOnlyRoot": True}), "spec.workdir", "below it"),
        (env(security={"pidsLimit": 5_000_000}), "spec.security.pidsLimit", "less than or equal"),
        (service(entrypoint="pkg.mod.fn"), "spec.entrypoint", "pattern"),
        (service(gpuMemoryGiB=0), "spec.gpuMemoryGiB", "greater than 0"),
        (service(dopChoices=[3]), "spec.dopChoices[0]", "Input should be 1, 2, 4 or 8"),
        (service(dopChoices=[2, 2]), "spec.dopChoices", "must not repeat"),
        (service(dopChoices=[]), "spec.dopChoices", "at least 1 item"),
        (
            service(profiles=[{"dop": 2, "t1Seconds": 1}]),
            "spec.profiles[0].dop",
            "2 is not one of dopChoices [1]",
        ),
        (
            service(profiles=[{"dop": 1, "t1Seconds": 1, "inputSize": {"min": 9, "max": 1}}]),
            "spec.profiles[0].inputSize",
            "min (9) is greater than max (1)",
        ),
        (
            service(
                profiles=[
                    {"dop": 1, "t1Seconds": 1, "inputSize": {"min": 0, "max": 100}},
                    {"dop": 1, "t1Seconds": 2, "inputSize": {"min": 100, "max": 200}},
                ]
            ),
            "spec.profiles[1]",
            "overlaps profiles[0]",
        ),
        (service(maxBatch=0), "spec.maxBatch", "greater than or equal to 1"),
    ],
)
def test_each_rule_names_the_field_in_yaml_spelling(doc: Any, path: str, words: str) -> None:
    found = problems(doc)
    kind, name = doc["kind"], doc["metadata"]["name"]
    assert any(
        p.startswith(f"test.yaml: document 1 ({kind}/{name}): {path}: ") and words in p
        for p in found
    ), found


def test_profiles_of_one_dop_for_disjoint_input_sizes_are_fine() -> None:
    doc = service(
        dopChoices=[1, 2],
        profiles=[
            {"dop": 1, "t1Seconds": 1, "inputSize": {"min": 0, "max": 99}},
            {"dop": 1, "t1Seconds": 2, "inputSize": {"min": 100, "max": 200}},
            {"dop": 2, "t1Seconds": 1},
        ],
    )
    assert len(parse(doc).services) == 1


def test_every_error_of_every_document_is_reported() -> None:
    bad_pool = pool(apis=[{"name": "a", "rate": 0}, {"name": "b", "concurrency": 0}])
    bad_env = env(name="x", memoryGiB=-1, workdir="rel")
    found = problems(bad_pool, pool("fine"), bad_env)
    assert found == [
        "test.yaml: document 1 (ActionPool/p): spec.apis[0].rate: "
        "Input should be greater than or equal to 1",
        "test.yaml: document 1 (ActionPool/p): spec.apis[1].concurrency: "
        "Input should be greater than or equal to 1",
        "test.yaml: document 3 (TrajectoryEnv/x): spec.memoryGiB: Input should be greater than 0",
        "test.yaml: document 3 (TrajectoryEnv/x): spec.workdir: String should match pattern '^/'",
    ]


def test_unknown_fields_are_rejected_by_name() -> None:
    doc = pool(cpu={"coresPerNod": 4})
    doc["sepc"] = {}
    found = problems(doc)
    assert any(p.endswith("(ActionPool/p): spec.cpu.coresPerNod: " + _UNKNOWN) for p in found)
    assert any(p.endswith("(ActionPool/p): sepc: " + _UNKNOWN) for p in found)


_UNKNOWN = "unknown field (misspelt? keys are camelCase)"


@pytest.mark.parametrize(
    "doc, path, words",
    [  # what the API server's schema refuses as the wrong JSON type, embedded mode too
        (pool(cpu={"idleCores": True}), "spec.cpu.idleCores", "valid integer"),
        (pool(cpu={}, scheduling={"depth": "2"}), "spec.scheduling.depth", "valid integer"),
        (pool(cpu={}, scheduling={"elastic": "yes"}), "spec.scheduling.elastic", "valid boolean"),
        (env(memoryGiB="1"), "spec.memoryGiB", "valid number"),
        (env(warmPool=1.5), "spec.warmPool", "valid integer"),
        (env(security={"user": "root:wheel:x"}), "spec.security.user", "should match"),
    ],
)
def test_values_of_the_wrong_type_are_refused_as_the_api_server_refuses_them(
    doc: Any, path: str, words: str
) -> None:
    """Coerced before (``true`` as one core, ``"yes"`` as true): files that ran here were
    then refused by ``kubectl apply``, though the same files are meant to run both ways."""
    (found,) = problems(doc)
    assert f": {path}: " in found and words in found, found


def test_whole_numbers_are_numbers() -> None:
    (e,) = parse(pool(), env(memoryGiB=1, actions=[{"name": "a", "t1Seconds": 2}])).envs.values()
    assert e.spec.memory_gib == 1.0 and e.spec.actions[0].t1_seconds == 2.0


def test_yaml_keys_must_be_camel_case() -> None:
    (found,) = problems(pool(cpu={"cores_per_node": 4}))
    assert found.endswith("spec.cpu.cores_per_node: " + _UNKNOWN)


def test_metadata_ignores_what_the_api_server_adds_and_status_is_accepted() -> None:
    doc = pool()
    doc["metadata"].update(
        uid="0b6c3d52",
        resourceVersion="4711",
        creationTimestamp="2025-01-01T00:00:00Z",
        managedFields=[{"manager": "kubectl"}],
        generation=3,
        labels={"app": "x"},
    )
    doc["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    p = parse(doc).pools[("default", "p")]
    assert p.metadata.generation == 3
    assert p.metadata.labels == {"app": "x"}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({**pool(), "kind": "ActionPools"}, "kind: 'ActionPools' is not a kind of tangram.dev"),
        ({**pool(), "apiVersion": "tangram.dev/v1"}, "apiVersion: 'tangram.dev/v1' is not served"),
        # Ours by kind, of another group (a typo): it was set aside as another API's.
        ({**env(), "apiVersion": "tangram.io/v1alpha1"}, "'tangram.io/v1alpha1' is not tangram"),
        ({**pool(), "apiVersion": "v1alpha1"}, "apiVersion: 'v1alpha1' is not tangram.dev's; use"),
        ({"kind": "ActionPool", "metadata": {"name": "p"}}, "apiVersion: required"),
        ({"apiVersion": "v1", "metadata": {"name": "p"}}, "kind: required"),
        (["a", "list"], "a manifest must be a mapping, not list"),
        # (kubectl's strict field validation refuses it; the pool ran in "default")
        (
            {**pool(), "metadata": {"name": "p", "namspace": "rl"}},
            "metadata.namspace: unknown field (misspelt? keys are camelCase)",
        ),
    ],
)
def test_documents_that_are_not_resources(doc: object, words: str) -> None:
    (found,) = problems(doc)
    assert found.startswith("test.yaml: document 1")
    assert words in found


def test_round_trip_through_camel_case_dump() -> None:
    resources = load_documents(sorted(p for p in EXAMPLES.iterdir() if p.is_dir()))
    objects = [*resources.pools.values(), *resources.envs.values(), *resources.services.values()]
    assert len(objects) == 11
    for obj in objects:
        data = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
        assert "apiVersion" in data
        again = type(obj).model_validate(data, by_alias=True, by_name=False)
        assert again == obj
    dumped = [o.model_dump(by_alias=True, exclude_none=True) for o in objects]
    assert len(parse(*dumped)) == len(objects)


# --- files, directories, other kinds ---------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


POOL = f"""
apiVersion: {API_VERSION}
kind: ActionPool
metadata: {{name: p}}
spec: {{cpu: {{}}}}
"""
ENV = f"""
apiVersion: {API_VERSION}
kind: TrajectoryEnv
metadata: {{name: e}}
spec: {{poolRef: p, image: img}}
"""
SECRET = """
apiVersion: v1
kind: Secret
metadata: {name: keys}
data: {token: c2VjcmV0}
"""
CONFIGMAP = """
apiVersion: v1
kind: ConfigMap
metadata: {name: cm, namespace: other}
data: {a: b}
"""


def test_multi_document_file_skips_empty_documents(tmp_path: Path) -> None:
    f = _write(tmp_path / "all.yaml", f"# a comment\n---\n{POOL}---\n---\n# nothing\n---{ENV}")
    resources = load_documents([f])
    assert list(resources.pools) == [("default", "p")]
    assert list(resources.envs) == [("default", "e")]
    assert resources.declared[("TrajectoryEnv", "default", "e")] == (f"{f}: document 4",)
    assert resources.check_references() == []


def test_numbers_are_read_as_kubectl_reads_them(tmp_path: Path) -> None:
    """PyYAML reads YAML 1.1, where ``1e-1`` is a string and ``2.0`` no integer; kubectl
    takes both (YAML 1.2 floats, and Go's JSON writes a whole float as an integer)."""
    spec = "{poolRef: p, image: img, memoryGiB: 5e-1, warmPool: 2.0, actions: [{name: a, "
    spec += "t1Seconds: 1E1}]}"
    f = _write(tmp_path / "p.yaml", POOL + "---" + ENV.replace("{poolRef: p, image: img}", spec))
    (e,) = load_documents([f]).envs.values()
    assert (e.spec.memory_gib, e.spec.warm_pool, e.spec.actions[0].t1_seconds) == (0.5, 2, 10.0)
    bad = _write(tmp_path / "q.yaml", ENV.replace("image: img", "image: img, warmPool: 2.5e0"))
    with pytest.raises(ResourceError) as err:
        load_documents([bad])
    assert "spec.warmPool" in str(err.value) and "valid integer" in str(err.value)


def test_errors_count_documents_from_one_including_empty_ones(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.yaml", f"---\n---\n{POOL.replace('{cpu: {}}', '{cpu: {}, x: 1}')}")
    with pytest.raises(ResourceError) as e:
        load_documents([f])
    assert e.value.problems == [f"{f}: document 2 (ActionPool/p): spec.x: {_UNKNOWN}"]


def test_directory_reads_yaml_and_json_files_sorted_and_not_recursively(tmp_path: Path) -> None:
    _write(tmp_path / "b.yml", ENV)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "k"},
        "stringData": {"t": "v"},
    }
    _write(tmp_path / "s.json", json.dumps(secret))
    _write(tmp_path / "a.yaml", POOL)
    _write(tmp_path / "c.txt", "not: [yaml")
    _write(tmp_path / "nested" / "d.yaml", POOL.replace("name: p", "name: q"))
    resources = load_documents([tmp_path])
    assert list(resources.pools) == [("default", "p")]
    assert list(resources.envs) == [("default", "e")]
    assert resources.secret_value("default", SecretRef(name="k", key="t")) == "v"
    assert resources.declared[("ActionPool", "default", "p")] == (
        f"{tmp_path / 'a.yaml'}: document 1",
    )


def test_other_api_groups_are_kept_apart(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.yaml", f"{SECRET}---{POOL}---{CONFIGMAP}")
    resources = load_documents([f])
    assert [d["kind"] for d in resources.other] == ["Secret", "ConfigMap"]
    assert resources.secret_value("default", SecretRef(name="keys", key="token")) == "secret"
    assert resources.secret_value("other", SecretRef(name="keys", key="token")) is None
    assert resources.secret_value("default", SecretRef(name="keys", key="nope")) is None


def test_secret_string_data_wins_over_data() -> None:
    encoded = base64.b64encode(b"old").decode()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "k"},
        "data": {"t": encoded},
        "stringData": {"t": "new"},
    }
    assert parse(secret).secret_value("default", SecretRef(name="k", key="t")) == "new"


def test_a_v1_list_is_unpacked() -> None:
    listed = {"apiVersion": "v1", "kind": "List", "items": [pool(), {**env(), "spec": {}}]}
    found = problems(listed)
    assert found[0].startswith("test.yaml: document 1 items[1] (TrajectoryEnv/e): spec.poolRef:")
    assert len(parse({**listed, "items": [pool(), env()]})) == 2


def test_errors_of_several_files_are_raised_together(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", POOL.replace("{cpu: {}}", "{}"))
    b = _write(tmp_path / "b.yaml", "kind: [unclosed\n")
    c = _write(tmp_path / "c.yaml", f"{ENV}\nspec: {{}}\n")
    with pytest.raises(ResourceError) as e:
        load_documents([a, b, c, tmp_path / "missing.yaml", tmp_path / "empty"])
    found = e.value.problems
    assert f"{tmp_path / 'missing.yaml'}: no such file or directory" in found
    assert any(p.startswith(f"{b}: document 1: not valid YAML: line 2") for p in found)
    assert any(p.startswith(f"{c}: document 1: not valid YAML") and "twice" in p for p in found)
    assert f"{a}: document 1 (ActionPool/p): spec: a pool needs cpu, gpu or apis" in found


def test_a_directory_without_manifests_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResourceError, match=r"no \*\.yaml, \*\.yml or \*\.json files"):
        load_documents([tmp_path / "empty"])


# --- references between documents -----------------------------------------------------------


def test_duplicates_of_one_kind_are_reported_with_their_places(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", POOL)
    b = _write(tmp_path / "b.yaml", f"{ENV}---{POOL.replace('{cpu: {}}', '{gpu: {}}')}")
    resources = load_documents([a, b])
    # The later declaration wins, as with kubectl apply.
    assert resources.pools[("default", "p")].spec.gpu is not None
    assert resources.check_references() == [
        f"ActionPool default/p is declared 2 times: {a}: document 1, {b}: document 2",
        f"TrajectoryEnv default/e ({b}: document 1): spec.poolRef: ActionPool p has no cpu section",
    ]


def test_same_name_in_other_kinds_or_namespaces_is_no_duplicate() -> None:
    res = parse(pool("p"), pool("p", "team"), env("p"), service("p"), pool("g", gpu={}))
    assert [p for p in res.check_references() if "declared" in p] == []


def test_two_of_one_name_in_one_pool_from_two_namespaces_are_reported() -> None:
    """Clients open an environment (call a service) by name alone: of two TrajectoryEnvs
    ``e`` the pool admits from two namespaces, one was dropped without a word."""
    res = parse(
        pool("p", cpu={}, access={"namespaces": ["default", "team"]}),
        env("e"),
        env("e", "team", poolRef="default/p"),
        env("f", "team", poolRef="default/p"),
    )
    assert res.check_references() == [
        "TrajectoryEnvs of one name, 'e', in ActionPool default/p, which its clients name by "
        "name alone: default/e (test.yaml: document 2), team/e (test.yaml: document 3); "
        "rename all but one"
    ]


def test_a_pool_is_chosen_by_name_or_namespace_and_name() -> None:
    from tangram.service.from_resources import PoolChoiceError, choose_pool

    res = parse(pool("p", "a", apis=[{"name": "alpha", "concurrency": 1}]),
                pool("p", "b", apis=[{"name": "beta", "concurrency": 1}]), pool("q"))  # fmt: skip
    assert choose_pool(res, "b/p").spec.apis[0].name == "beta"
    assert choose_pool(res, "q").metadata.namespace == "default"
    # (the first of two was served, and the second could not be named)
    with pytest.raises(PoolChoiceError, match=r"2 ActionPools are named 'p'; .*: a/p, b/p"):
        choose_pool(res, "p")
    with pytest.raises(PoolChoiceError, match=r"3 ActionPools declared \(a/p, b/p, default/q\)"):
        choose_pool(res, None)
    with pytest.raises(PoolChoiceError, match=r"no ActionPool 'c/p' \(declared: a/p, b/p"):
        choose_pool(res, "c/p")
    # A reload of a pool served without --pool, after a second pool's file was added: the
    # pool served, not a refusal asking for --pool.
    assert choose_pool(res, None, serving="b/p").spec.apis[0].name == "beta"
    with pytest.raises(PoolChoiceError, match=r"none of them c/p, the one served; a new pool"):
        choose_pool(res, None, serving="c/p")


def test_dangling_and_unusable_references_are_reported() -> None:
    res = parse(
        pool("p"),
        pool("shared", "infra", cpu={}, gpu={"gpusPerNode": 2}),
        pool("open", "infra", cpu={}, access={"namespaces": ["*"]}),
        env("lost", poolRef="nowhere"),
        env("across", "team", poolRef="infra/shared"),
        env("fine", "team", poolRef="infra/open"),
        service("nogpu", poolRef="p"),
        service("big", "infra", poolRef="shared", dopChoices=[4, 8]),
        service("lost", "team", poolRef="p"),
        pool("small", cpu={"coresPerNode": 2}),
        env("wide", poolRef="small", cpu={"min": 4, "max": 8}),
        env("one-wide", poolRef="small", actions=[{"name": "t", "cpu": {"choices": [3, 6]}}]),
        env("narrow", poolRef="small", cpu=2),
    )
    assert res.check_references() == [
        "TrajectoryEnv default/lost (test.yaml: document 4): spec.poolRef: "
        "no ActionPool default/nowhere",
        "TrajectoryEnv team/across (test.yaml: document 5): spec.poolRef: "
        "ActionPool infra/shared does not admit namespace team (spec.access.namespaces)",
        "TrajectoryEnv default/wide (test.yaml: document 11): spec.poolRef: spec.cpu needs at "
        "least 4 cores; coresPerNode of ActionPool small is 2",
        "TrajectoryEnv default/one-wide (test.yaml: document 12): spec.poolRef: "
        "spec.actions[t].cpu needs at least 3 cores; coresPerNode of ActionPool small is 2",
        "RewardService default/nogpu (test.yaml: document 7): spec.poolRef: "
        "ActionPool p has no gpu section",
        "RewardService infra/big (test.yaml: document 8): spec.poolRef: "
        "dopChoices [4, 8] do not fit in gpusPerNode 2 of ActionPool shared",
        "RewardService team/lost (test.yaml: document 9): spec.poolRef: no ActionPool team/p",
    ]


def test_references_of_hand_built_resources() -> None:
    e = TrajectoryEnv.model_validate(env(poolRef="missing"))
    assert Resources(envs={e.key: e}).check_references() == [
        "TrajectoryEnv default/e: spec.poolRef: no ActionPool default/missing"
    ]


def test_tenant_policies_reach_the_schedulers_config() -> None:
    from tangram.service.config import NO_LIMITS, TenantLimits
    from tangram.service.from_resources import pool_config

    tenants = [
        {"name": "system:serviceaccount:team-a:rollout", "weight": 3, "maxShare": 0.5},
        {"name": "*", "maxTrajectories": 64, "maxQueued": 1000},
    ]
    res = parse(pool(cpu={}, access={"tenants": tenants}))
    config = pool_config(res, res.pools[("default", "p")])
    assert config.limits("system:serviceaccount:team-a:rollout") == TenantLimits(
        weight=3.0, max_share=0.5
    )
    assert config.limits("anyone") == TenantLimits(max_trajectories=64, max_queued=1000)
    assert parse(pool(cpu={})).pools[("default", "p")].spec.access.tenants == []
    assert config.scheduling.tenant_fairness
    off = parse(pool(cpu={}, scheduling={"tenantFairness": False}))
    assert not pool_config(off, off.pools[("default", "p")]).scheduling.tenant_fairness
    plain = parse(pool(cpu={}))
    assert pool_config(plain, plain.pools[("default", "p")]).limits("x") is NO_LIMITS


def test_quota_waiting_is_hold_unless_the_pool_says_pass() -> None:
    from tangram.service.from_resources import pool_config

    plain = parse(pool(cpu={}))
    assert pool_config(plain, plain.pools[("default", "p")]).scheduling.quota_waiting == "hold"
    passing = parse(pool(cpu={}, scheduling={"quotaWaiting": "pass"}))
    config = pool_config(passing, passing.pools[("default", "p")])
    assert config.scheduling.quota_waiting == "pass"
    with pytest.raises(ResourceError, match="quotaWaiting"):
        parse(pool(cpu={}, scheduling={"quotaWaiting": "skip"}))


def test_the_core_price_is_arrivals_unless_the_pool_says_otherwise() -> None:
    from tangram.service.from_resources import pool_config

    plain = parse(pool(cpu={}))
    assert pool_config(plain, plain.pools[("default", "p")]).scheduling.core_price == "arrivals"
    for rule in ("load", "none"):
        chosen = parse(pool(cpu={}, scheduling={"corePrice": rule}))
        assert pool_config(chosen, chosen.pools[("default", "p")]).scheduling.core_price == rule
    with pytest.raises(ResourceError, match="corePrice"):
        parse(pool(cpu={}, scheduling={"corePrice": "cheap"}))


def test_batching_reaches_the_service_config_and_bad_values_name_the_field() -> None:
    from tangram.service.from_resources import service_config

    res = parse(pool(), service(batching={"maxCalls": 4, "slowdown": 0.25}))
    cfg = service_config(res.services[("default", "s")])
    assert (cfg.max_calls, cfg.batch_slowdown) == (4, 0.25)
    alone = service_config(parse(pool(), service()).services[("default", "s")])
    assert (alone.max_calls, alone.batch_slowdown) == (1, 0.0)
    with pytest.raises(ResourceError, match=r"spec\.batching\.maxCalls"):
        parse(pool(), service(batching={"maxCalls": 0}))
    with pytest.raises(ResourceError, match=r"spec\.batching\.slowdown"):
        parse(pool(), service(batching={"slowdown": -1}))


def test_an_actions_env_names_are_whole_variable_names() -> None:
    from tangram.api.wire import ExecRequest

    assert ExecRequest(argv=["env"], env={"GOOD_1": "x"}).env == {"GOOD_1": "x"}
    for bad in ("1BAD", "MY-VAR", "TRAILING\n"):
        with pytest.raises(ValidationError, match="is not a variable name"):
            ExecRequest(argv=["env"], env={bad: "x"})


def test_a_secret_ref_that_cannot_be_resolved_refuses_the_pool_or_only_its_calls() -> None:
    """A reload refuses the whole pool; `tangram serve --kubernetes` starts with the quota's
    calls refused, since the operator's ConfigMap may name a Secret not made yet."""
    from tangram.service.from_resources import PoolChoiceError, pool_config

    ref = {"name": "key", "key": "token"}
    res = parse(pool(apis=[{"name": "q", "concurrency": 1, "endpoint": "http://127.0.0.1:9",
                             "secretRef": ref}]))  # fmt: skip
    p = res.pools[("default", "p")]

    def missing(namespace: str, r: object) -> str:
        raise LookupError("no Secret key in namespace default")

    with pytest.raises(PoolChoiceError, match=r"apis\[q\]\.secretRef: no Secret key"):
        pool_config(res, p, missing)
    endpoint = pool_config(res, p, missing, unresolved_ok=True).endpoints["q"]
    assert endpoint.credential is None
    assert endpoint.unresolved == (
        "ActionPool p: apis[q].secretRef: no Secret key in namespace default"
    )
    found = pool_config(res, p, lambda ns, r: "k", unresolved_ok=True)
    assert found.endpoints["q"].unresolved is None


def test_what_the_api_server_takes_in_a_childs_resources_and_node_selector_is_taken() -> None:
    requests = {"cpu": "500m", "memory": "1Gi", "example.com/fpga": 1}
    limits = {"cpu": 1, "memory": "1073741824", "hugepages-2Mi": "2Mi", "example.com/fpga": "1"}
    res = parse(pool(
        cpu={"nodeSelector": {"kubernetes.io/os": "linux", "node-role.kubernetes.io/rl": ""}},
        scheduler={"resources": {"requests": requests, "limits": limits}},
    ))  # fmt: skip
    spec = res.pools[("default", "p")].spec
    assert spec.cpu is not None and spec.cpu.node_selector["node-role.kubernetes.io/rl"] == ""
    assert spec.scheduler.resources == {"requests": requests, "limits": limits}
