"""The scheduler's Kubernetes API adapter: TokenReviews, the Secrets of ``secretRef``, and
the ConfigMap that keeps what the scheduler learned.

The only module of the service that imports the ``kubernetes`` client. In a pod it uses the
mounted ServiceAccount (in-cluster config); elsewhere ``$KUBECONFIG`` or ``~/.kube/config``
(how e2e tests run the scheduler as a local process with its pod's identity). What it may
do is what the operator's Role grants: create TokenReviews, get the named Secrets, get and
patch the pool's learned-state ConfigMap.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tangram import kube
from tangram.api.resources import SecretRef
from tangram.service.reviews import ReviewError


class KubeError(ReviewError):
    """The API server could not be reached or refused the scheduler."""


def api_client(kubeconfig: str | None = None) -> Any:
    """A client for the pod's ServiceAccount in a cluster, else for a kubeconfig; its calls
    are bounded (``tangram.kube``)."""
    try:
        return kube.api_client(kubeconfig)
    except config.ConfigException as e:
        raise KubeError(f"no Kubernetes credentials: {e}") from None


class KubeApi:
    def __init__(self, api: Any) -> None:
        self._auth = client.AuthenticationV1Api(api)
        self._core = client.CoreV1Api(api)

    def review_sync(self, token: str) -> str | None:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
        try:
            status = self._auth.create_token_review(body).status
        except ApiException as e:
            raise KubeError(f"TokenReview failed: {e.status} {e.reason}") from None
        except urllib3.exceptions.HTTPError as e:
            raise KubeError(f"TokenReview failed: API server unreachable ({e})") from None
        if status is None or not status.authenticated or status.user is None:
            return None
        return str(status.user.username)

    async def review(self, token: str) -> str | None:
        """The token's username, or None when the API server does not accept it."""
        return await asyncio.to_thread(self.review_sync, token)

    def secret(self, namespace: str, ref: SecretRef) -> str:
        """A Secret's key, decoded; LookupError naming what is missing or forbidden."""
        try:
            obj = self._core.read_namespaced_secret(ref.name, namespace)
        except ApiException as e:
            if e.status == 404:
                raise LookupError(f"no Secret {ref.name} in namespace {namespace}") from None
            if e.status == 403:
                raise LookupError(
                    f"Secret {namespace}/{ref.name}: forbidden (the scheduler's Role names only "
                    "the Secrets of spec.apis[*].secretRef; the operator refreshes it)"
                ) from None
            raise LookupError(f"Secret {namespace}/{ref.name}: {e.status} {e.reason}") from None
        except urllib3.exceptions.HTTPError as e:
            raise LookupError(
                f"Secret {namespace}/{ref.name}: API server unreachable ({e})"
            ) from None
        encoded = (obj.data or {}).get(ref.key)
        if encoded is None:
            raise LookupError(f"Secret {namespace}/{ref.name} has no key {ref.key}")
        try:
            return base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise LookupError(f"Secret {namespace}/{ref.name}: {ref.key} is not UTF-8") from None


LEARNED_KEY = "learned.json"


class LearnedConfigMap:
    """The scheduler's learned state (``service.learned_file``) as one key of a ConfigMap
    the operator makes for the pool, owned by it: it outlives the scheduler's pod (an
    upgrade, an eviction) and goes with the pool. The Role names this ConfigMap alone."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self._core = client.CoreV1Api(api)
        self.namespace, self.name = namespace, name

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def read(self) -> bytes | None:
        obj = self._call(self._core.read_namespaced_config_map, self.name, self.namespace)
        text = (obj.data or {}).get(LEARNED_KEY)
        return None if text is None else str(text).encode()

    def write(self, document: bytes) -> None:
        self._patch({LEARNED_KEY: document.decode()})

    def set_aside(self, document: bytes) -> str:
        self._patch({LEARNED_KEY: None, f"{LEARNED_KEY}.bad": document.decode()})
        return f"its key {LEARNED_KEY}.bad"

    def close(self) -> None:
        pass  # nothing held: one scheduler a pool, its Deployment's (Recreate)

    def _patch(self, data: dict[str, str | None]) -> None:
        self._call(self._core.patch_namespaced_config_map, self.name, self.namespace,
                   {"data": data})  # fmt: skip

    def _call(self, method: Any, *args: Any) -> Any:
        """``method(*args)``; OSError naming the ConfigMap and what went wrong."""
        try:
            return method(*args)
        except ApiException as e:
            if e.status == 404:
                why = "not found (the operator makes it with the pool)"
            elif e.status == 403:
                why = "forbidden (the scheduler's Role must name this ConfigMap)"
            else:
                why = f"{e.status} {e.reason}"
            raise OSError(f"{self.where}: {why}") from None
        except urllib3.exceptions.HTTPError as e:
            raise OSError(f"{self.where}: API server unreachable ({e})") from None


__all__ = ["LEARNED_KEY", "KubeApi", "KubeError", "LearnedConfigMap", "api_client"]
