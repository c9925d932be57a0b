"""The few Kubernetes API calls a worker makes for rank pods, over httpx with its in-cluster identity.

In a pod, the API server is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, trusted with the
service account's CA, and the bearer token is the service account's projected token file (re-read before
each request: the kubelet rotates it). What the worker may do is its Role's: pods, serviceaccounts,
services and networkpolicies in the rank namespace, nothing else (deploy/k8s/jobs/rbac.yaml).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from vigil.errors import PermanentError, RetryableError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0

Doc = dict[str, Any]

# kind -> (API path prefix, resource): the only kinds the worker touches
RESOURCES = {
    "Pod": ("/api/v1", "pods"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Service": ("/api/v1", "services"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
}


class KubeError(PermanentError):
    """The API server refused a request for good (403, 422, ...): the message names the object."""


class KubeUnavailable(RetryableError):
    """The API server did not answer, or answered 429 or 5xx: try again."""


def in_cluster_namespace(directory: Path = SERVICE_ACCOUNT) -> str | None:
    """The worker's own namespace, as its service account's files say; None outside a pod."""
    try:
        return (directory / "namespace").read_text().strip() or None
    except OSError:
        return None


class KubeApi:
    """Namespaced create, list (by label), delete and log reads, for the kinds in RESOURCES."""

    def __init__(
        self,
        base_url: str,
        namespace: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.namespace = namespace
        self.token_file = token_file
        verify: Any = str(ca_file) if ca_file is not None else True
        self._http = httpx.AsyncClient(base_url=base_url, verify=verify, timeout=TIMEOUT_S)

    @classmethod
    def in_cluster(cls, namespace: str, base_url: str | None = None) -> KubeApi:
        """The API server this pod runs under (or `base_url`), with this pod's service account."""
        if base_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise KubeError(
                    "VIGIL_RANK_RUNTIME=kubernetes: not in a pod (no KUBERNETES_SERVICE_HOST); "
                    "set VIGIL_K8S_API_URL or VIGIL_RANK_RUNTIME=process"
                )
            base_url = f"https://{host}:{port}"
        ca = SERVICE_ACCOUNT / "ca.crt"
        token = SERVICE_ACCOUNT / "token"
        return cls(
            base_url,
            namespace,
            token_file=token if token.exists() else None,
            ca_file=ca if ca.exists() and base_url.startswith("https") else None,
        )

    async def close(self) -> None:
        await self._http.aclose()

    def _path(self, kind: str, name: str | None = None) -> str:
        prefix, resource = RESOURCES[kind]
        path = f"{prefix}/namespaces/{self.namespace}/{resource}"
        return f"{path}/{name}" if name else path

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {}
        if self.token_file is not None:
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        try:
            response = await self._http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeUnavailable(f"Kubernetes API {method} {path}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise KubeUnavailable(
                f"Kubernetes API {method} {path}: {response.status_code} {_reason(response)}"
            )
        return response

    async def create(self, doc: Doc) -> bool:
        """Create `doc` in the namespace; False when it exists already (a retried create)."""
        kind, name = doc["kind"], doc["metadata"]["name"]
        response = await self._request("POST", self._path(kind), json=doc)
        if response.status_code == 409:
            return False
        if response.status_code >= 400:
            raise KubeError(f"creating {kind} {name}: {response.status_code} {_reason(response)}")
        return True

    async def delete(self, kind: str, name: str, grace_s: int | None = None) -> bool:
        """Delete an object (a pod with `grace_s` to end); False when it is gone already."""
        body: Doc = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_s is not None:
            body["gracePeriodSeconds"] = max(0, int(grace_s))
        response = await self._request("DELETE", self._path(kind, name), json=body)
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise KubeError(f"deleting {kind} {name}: {response.status_code} {_reason(response)}")
        return True

    async def list(self, kind: str, selector: dict[str, str]) -> list[Doc]:
        """The objects of `kind` whose labels include `selector`."""
        labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        response = await self._request("GET", self._path(kind), params={"labelSelector": labels})
        if response.status_code >= 400:
            raise KubeError(f"listing {kind} ({labels}): {response.status_code} {_reason(response)}")
        items: list[Doc] = response.json().get("items", [])
        return items

    async def log_tail(self, pod: str, container: str, limit_bytes: int) -> str:
        """The end of a container's log (at most `limit_bytes`), or "" when there is none to read."""
        response = await self._request(
            "GET", f"{self._path('Pod', pod)}/log", params={"container": container, "limitBytes": limit_bytes,
                                                            "tailLines": 200}
        )  # fmt: skip
        return response.text[-limit_bytes:] if response.status_code == 200 else ""


def _reason(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message", ""))[:300]
    except ValueError:
        return response.text[:300]
