"""The Kubernetes API client the operator, the scheduler and the node agent's pod runtime
share: one way to find credentials, and calls that cannot hang.

The ``kubernetes`` client waits for an answer forever unless each call passes a timeout,
and urllib3 retries a read that timed out three times by default, so an API server that
stops answering held a call (a kopf handler's thread, a TokenReview, the learned-state
save) for good. Every call made with :func:`api_client` has a (connect, read) timeout
unless it gives its own, and is tried once after a failed connect, never after a read:
what fails is an error its caller reports or retries at its own pace.
"""

from __future__ import annotations

import os
from typing import Any

from kubernetes import client, config
from kubernetes.client import rest
from urllib3.util.retry import Retry

__all__ = ["REQUEST_TIMEOUT", "api_client"]

# (connect, read) seconds. The read allows for admission webhooks (30 s at most each).
REQUEST_TIMEOUT = (5.0, 40.0)


class _BoundedRest(rest.RESTClientObject):
    """The REST layer every call of an ApiClient goes through (whatever the client's
    generation), giving a call without a ``_request_timeout`` :data:`REQUEST_TIMEOUT`."""

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        kwargs["_request_timeout"] = kwargs.get("_request_timeout") or REQUEST_TIMEOUT
        return super().request(method, url, *args, **kwargs)  # type: ignore[no-untyped-call]


def api_client(kubeconfig: str | None = None) -> Any:
    """In a pod (and no ``kubeconfig`` given): its ServiceAccount, whose rotated token the
    client re-reads; elsewhere ``kubeconfig``, else ``$KUBECONFIG`` or ``~/.kube/config``.
    ``config.ConfigException`` when neither holds credentials."""
    settings = client.Configuration()
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config(client_configuration=settings)  # type: ignore[no-untyped-call]
    else:
        if kubeconfig is not None and not os.path.isfile(kubeconfig):  # (the client: "no
            # configuration found", as for an empty one)
            raise config.ConfigException(f"kubeconfig {kubeconfig}: no such file")
        config.load_kube_config(config_file=kubeconfig, client_configuration=settings)  # type: ignore[no-untyped-call]
    settings.retries = Retry(total=2, connect=1, read=0, redirect=0, status=0)
    api = client.ApiClient(settings)
    api.rest_client = _BoundedRest(settings)
    return api
