"""The CamelCase reasons of conditions and Events, in one place.

The operator writes them on the custom resources' conditions and Events; the node agents
name sandbox failures with them, the scheduler counts those per cause, and the operator
shows the latest as the pool's SandboxesHealthy reason. docs/operator.md and
docs/node-agent.md explain each and what to do. On the wire a reason stays a plain string:
an agent newer than its scheduler may send one this list does not have yet.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # An ActionPool's Ready condition.
    READY = "Ready"
    INVALID_SPEC = "InvalidSpec"  # also a member's: what CEL cannot check, pydantic does
    DRAINING = "Draining"
    SCHEDULER_UNAVAILABLE = "SchedulerUnavailable"
    SCHEDULER_UNREACHABLE = "SchedulerUnreachable"
    CONFIG_REFUSED = "ConfigRefused"  # the running scheduler refused the pushed spec
    NO_NODES = "NoNodes"
    AGENTS_STOPPING = "AgentsStopping"  # every agent connected said it stops (a roll)
    NO_GPUS = "NoGpus"  # a pool with spec.gpu whose scheduler has no GPU
    CHILD_DENIED = "ChildDenied"  # the API server denied a child (400/403: a webhook, quota)
    APPLY_FAILED = "ApplyFailed"  # the API server failed to take a child (5xx, no answer)
    CONFIG_PUSH_FAILED = "ConfigPushFailed"  # the push to the scheduler failed (not a 400)
    # A TrajectoryEnv's or RewardService's Ready condition.
    ACCEPTED = "Accepted"
    POOL_NOT_FOUND = "PoolNotFound"
    POOL_INVALID = "PoolInvalid"  # the pool exists, but its spec does not validate
    NAMESPACE_NOT_ADMITTED = "NamespaceNotAdmitted"
    NO_CPU_SECTION = "NoCpuSection"
    NO_GPU_SECTION = "NoGpuSection"
    DOP_DOES_NOT_FIT = "DopDoesNotFit"
    NOT_SERVED = "NotServed"  # its pool's scheduler has not been given it (yet)
    # Another member of its kind serves its name in the pool (from another namespace).
    NAME_TAKEN = "NameTaken"
    POOL_CONFIG_REFUSED = "PoolConfigRefused"  # its pool's scheduler refused the push
    # An ActionPool's SandboxesHealthy condition: quiet, or the latest failure's cause.
    NO_RECENT_FAILURES = "NoRecentFailures"
    IMAGE_UNAVAILABLE = "ImageUnavailable"  # not on the node and not pullable
    RUNTIME_CLASS_NOT_FOUND = "RuntimeClassNotFound"  # runtimeClassName names none
    RUNTIME_CLASS_UNAVAILABLE = "RuntimeClassUnavailable"  # the node lacks its handler
    SANDBOX_START_FAILED = "SandboxStartFailed"  # could not be created or started
    SANDBOX_START_TIMEOUT = "SandboxStartTimeout"  # not running within the start timeout
    SETUP_FAILED = "SetupFailed"  # a setup command of the TrajectoryEnv failed
    CGROUPS_UNWRITABLE = "CgroupsUnwritable"  # the agent cannot write the sandbox's cgroup
    SANDBOX_EVICTED = "SandboxEvicted"  # the kubelet evicted it (node pressure)
    DISK_LIMIT_EXCEEDED = "DiskLimitExceeded"  # it wrote more than the env's diskGiB
    SANDBOX_OOM_KILLED = "SandboxOOMKilled"  # its processes ran out of the env's memory
    SANDBOX_EXITED = "SandboxExited"  # its exec server ended
    SANDBOX_DELETED = "SandboxDeleted"  # someone deleted it
    CPU_MANAGER_STATIC = "CPUManagerStatic"  # the kubelet rewrites container cpusets itself
    # The scheduler's: a TrajectoryEnv's memoryGiB is more than any node of the pool has.
    MEMORY_DOES_NOT_FIT = "MemoryDoesNotFit"
    # The scheduler's: a second agent of the pool for a node (its CPU and GPU agents).
    DUPLICATE_AGENT = "DuplicateAgent"


# The causes a node agent names a failed sandbox (or refused node) with.
SANDBOX_FAILURES = frozenset(
    {
        Reason.IMAGE_UNAVAILABLE,
        Reason.RUNTIME_CLASS_NOT_FOUND,
        Reason.RUNTIME_CLASS_UNAVAILABLE,
        Reason.SANDBOX_START_FAILED,
        Reason.SANDBOX_START_TIMEOUT,
        Reason.SETUP_FAILED,
        Reason.CGROUPS_UNWRITABLE,
        Reason.SANDBOX_EVICTED,
        Reason.DISK_LIMIT_EXCEEDED,
        Reason.SANDBOX_OOM_KILLED,
        Reason.SANDBOX_EXITED,
        Reason.SANDBOX_DELETED,
        Reason.CPU_MANAGER_STATIC,
    }
)
