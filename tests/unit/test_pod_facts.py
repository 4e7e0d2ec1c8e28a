"""The pod runtime learns an image's user and workdir from a pod made without them; a pod
made while another thread learnt them is judged by them too, not kept as it is (it would
run as the image's USER, e.g. root without capabilities, unable to write the workdir)."""

from __future__ import annotations

from pathlib import Path

from tangram.api.wire import EnvSpec
from tangram.node_agent.env_template import User, Workdir
from tangram.node_agent.fast_path import Reachable
from tangram.node_agent.pod_runtime import PodRuntime

SPEC = EnvSpec(name="swe", image="swe:1", workdir="/work", user="1000:1000")


def _runtime(proc: Path, uid: int) -> PodRuntime:
    rt = object.__new__(PodRuntime)  # only the facts and /proc: no cluster, no cgroups
    rt.proc_root = proc
    rt._facts = {}
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "status").write_text(f"Name:\texecd\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
                                        f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}\n")  # fmt: skip
    return rt


def _reach(proc: Path) -> Reachable:
    return Reachable("c", proc / "sock", 42, "g", "/work", proc_root=proc)


def test_a_pod_made_while_another_learnt_the_facts_is_redone_if_it_runs_as_another(
    tmp_path: Path,
) -> None:
    rt = _runtime(tmp_path, uid=0)  # made without runAsUser: the image's USER, root
    rt._facts[PodRuntime._facts_key(SPEC)] = (User(1000, 1000), Workdir(1000, 1000, 0o755))
    assert rt._learn_facts(SPEC, _reach(tmp_path)) is True


def test_a_pod_made_as_the_facts_say_is_kept(tmp_path: Path) -> None:
    rt = _runtime(tmp_path, uid=1000)
    rt._facts[PodRuntime._facts_key(SPEC)] = (User(1000, 1000), Workdir(1000, 1000, 0o755))
    assert rt._learn_facts(SPEC, _reach(tmp_path)) is False
