"""The scheduler's Kubernetes API adapter: TokenReviews and the Secrets of ``secretRef``.

The only module of the service that imports the ``kubernetes`` client. In a pod it uses the
mounted ServiceAccount (in-cluster config); elsewhere ``$KUBECONFIG`` or ``~/.kube/config``
(how e2e tests run the scheduler as a local process with its pod's identity). What it may
do is what the operator's Role grants: create TokenReviews, get the named Secrets.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tangram.api.resources import SecretRef
from tangram.service.reviews import ReviewError


class KubeError(ReviewError):
    """The API server could not be reached or refused the scheduler."""


def api_client(kubeconfig: str | None = None) -> Any:
    """A client for the pod's ServiceAccount in a cluster, else for a kubeconfig."""
    try:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.ApiClient()
        return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
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


__all__ = ["KubeApi", "KubeError", "api_client"]
