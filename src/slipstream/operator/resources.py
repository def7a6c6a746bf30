"""Pure renderers: an InferenceService (dict) → the Deployment, Service and PodDisruptionBudget
(dicts) it owns; the gateway's objects are rendered by gateway_resources.py, all of them together
by render.py.

Nothing here talks to a cluster; ``slipstream operator render`` prints what these return, and the
reconcile loop applies it. Shapes follow apps/v1 Deployment, core/v1 Service and policy/v1
PodDisruptionBudget.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Any, Mapping

from kubernetes.utils.quantity import parse_quantity

from slipstream.api_types.inference_service import GROUP, KIND, PLURAL, VERSION
from slipstream.api_types.parallelism import (LEADER_WORKER_INDEX, LWS_LEADER_ADDRESS_ENV, LWS_WORKER_INDEX_ENV,
                                              LWS_WORKER_INDEX_LABEL, MASTER_ADDR_FLAG, MASTER_PORT,
                                              MASTER_PORT_FLAG, NNODES_FLAG, NODE_RANK_FLAG,
                                              PIPELINE_PARALLEL_FLAG, TENSOR_PARALLEL_FLAG)
from slipstream.api_types.tenancy import DEFAULT_SCHEDULING_POLICY
from slipstream.operator.model_spec import (MODEL_IMAGE_DIR, ModelCacheSpec, ModelLocation, model_location,
                                            quantity_bytes, use_image_volume)
from slipstream.operator.spec import InferenceServiceSpec, SpecError, parse_spec

API_VERSION = f"{GROUP}/{VERSION}"

MANAGED_BY = "slipstream-operator"
INSTANCE_LABEL = "slipstream.dev/inferenceservice"
# The hash of the rendered Deployment: a spec change that removes a field still shows as a change.
SPEC_HASH_ANNOTATION = "slipstream.dev/spec-hash"
CONTAINER_NAME = "server"
PORT_NAME = "http"
SERVICE_PORT = 80
MODEL_MOUNT = "/mnt/models"
# hf:// and s3:// weights: the init container downloads into this volume, the server reads them
# from it with the Hub client offline (it never downloads; server_env).
DOWNLOAD_CONTAINER = "model-download"
MODEL_CACHE_VOLUME = "model-cache"
MODEL_CACHE_MOUNT = "/var/cache/slipstream/models"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# The download step also writes its result (the resolved revision) into a pod-local emptyDir; the
# server serves exactly that revision (serve --model-revision-file), so one restarted in place
# does not pick up a newer `main` that another service's pod fetched into a shared cache meanwhile.
MODEL_REVISION_VOLUME = "model-revision"
MODEL_REVISION_MOUNT = "/mnt/model-revision"
MODEL_REVISION_FILE = f"{MODEL_REVISION_MOUNT}/revision.json"
# oci:// weights: an image volume's mount point, or the emptyDir where the modelcar sidecar
# links its image's model directory (through /proc/PID/root; the pod shares one PID namespace).
MODEL_IMAGE_MOUNT = "/mnt/model-image"
MODELCAR_CONTAINER = "modelcar"
MODELCAR_LINK_MOUNT = "/mnt/modelcar"
MODELCAR_SINCE = (1, 29)  # native sidecars (initContainers with restartPolicy Always) on by default
# The rollout's deadline allows this long for a download on top of the startup budget.
DOWNLOAD_BUDGET_SECONDS = 3600
# /dev/shm of GPU pods and of pods with several tensor-parallel ranks (PyTorch's, NCCL's and gloo's
# shared buffers; the runtime's 64 MiB default is too small for NCCL, whose buffers grow with ranks
# and channels; 2 GiB holds 8 ranks): memory-backed, so it counts against the memory limit;
# capped at a quarter of it. No hostIPC: NCCL's transports between the ranks of one pod are
# /dev/shm and CUDA IPC, both inside the pod's own IPC namespace.
SHM_MOUNT = "/dev/shm"
SHM_SIZE_LIMIT_BYTES = 2 << 30
# Seconds the preStop hook waits before the kubelet sends SIGTERM (which starts the drain):
# endpoint controllers and kube-proxy take a moment to stop routing to a terminating pod.
PRESTOP_SLEEP_SECONDS = 5
PROBE_PERIOD_SECONDS = 5
# The server image's user (docker/server.Dockerfile: useradd --uid 10001), named explicitly so
# a cluster can check runAsNonRoot without reading the image.
POD_UID = 10001
# PodSecurity "restricted" (GPU pods too): non-root, no privilege escalation, no capabilities,
# the runtime's default seccomp profile.
POD_SECURITY_CONTEXT = {"runAsNonRoot": True, "runAsUser": POD_UID, "runAsGroup": POD_UID,
                        "fsGroup": POD_UID, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False,
                              "capabilities": {"drop": ["ALL"]}}


def labels(name: str) -> dict[str, str]:
    """Labels every child and every pod of InferenceService ``name`` carries."""
    return {
        "app.kubernetes.io/name": "slipstream",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        INSTANCE_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's and Service's pod selector (immutable on a Deployment: keep it small)."""
    return {INSTANCE_LABEL: name, "app.kubernetes.io/component": "model-server"}


GATEWAY_COMPONENT = "gateway"


def gateway_selector_labels(name: str) -> dict[str, str]:
    """The gateway pods' selector (gateway_resources.py), which the Service ``name`` uses while
    routing is enabled: the model pods' with component ``gateway``."""
    return {INSTANCE_LABEL: name, "app.kubernetes.io/component": GATEWAY_COMPONENT}


def serving_selector_labels(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """The pods that serve the API: :func:`selector_labels`, and with ``parallelism.pipeline``
    > 1 only each group's leader (LWS labels it worker-index 0; the others run workers only).
    What the Services, the scale subresource's selector and the autoscaler's scrape select."""
    if spec.pipeline_parallel_size > 1:
        return {**selector_labels(name), LWS_WORKER_INDEX_LABEL: LEADER_WORKER_INDEX}
    return selector_labels(name)


def serving_pod_selector(name: str, spec: InferenceServiceSpec) -> str:
    """:func:`serving_selector_labels` as a label-selector string."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_selector_labels(name, spec).items()))


def pod_selector(name: str) -> str:
    """``selector_labels`` as a label-selector string (``kubectl get pods -l …``; the scale
    subresource's ``status.selector``; the scraper's pod listing)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def service_url(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """The in-cluster URL of the Service (port 80, so no port in the URL)."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}"


def model_argument(spec: InferenceServiceSpec, kube_version: tuple[int, int] | None = None) -> str:
    """What ``slipstream serve --model`` gets: ``builtin``, ``sim:PROFILE``, the ``hf://`` or
    ``s3://`` uri (read from the model cache) or a path inside the container."""
    location = model_location(spec.model)
    if location.kind == "pvc":
        return f"{MODEL_MOUNT}/{location.path}".rstrip("/")
    if location.kind == "image":
        return location.path
    if location.kind == "oci":
        if use_image_volume(spec.model, kube_version):
            return MODEL_IMAGE_MOUNT + MODEL_IMAGE_DIR
        return MODELCAR_LINK_MOUNT + MODEL_IMAGE_DIR
    return location.uri


def server_args(spec: InferenceServiceSpec, name: str,
                kube_version: tuple[int, int] | None = None) -> list[str]:
    """The ``slipstream serve`` argument list (after the ``slipstream`` command)."""
    engine = spec.engine
    args = [
        "serve",
        "--model", model_argument(spec, kube_version),
        "--host", "0.0.0.0",
        "--port", str(spec.port),
        "--served-model-name", spec.model.served_model_name or name,
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--block-size", str(engine.block_size),
        "--shutdown-timeout", str(spec.shutdown_timeout_seconds),
    ]
    if model_location(spec.model).downloaded:
        args += ["--model-cache-dir", MODEL_CACHE_MOUNT, "--model-revision-file", MODEL_REVISION_FILE]
    # Unset, the engine sizes the KV pool itself: from free GPU memory after profiling on CUDA.
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory-bytes", str(quantity_bytes(engine.kv_cache_memory))]
    if engine.gpu_memory_utilization is not None:
        fraction = engine.gpu_memory_utilization  # a float: 1 is 1.0
        args += ["--gpu-memory-utilization", str(int(fraction)) if fraction.is_integer() else str(fraction)]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    if engine.quantization is not None:
        args += ["--quantization", engine.quantization]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.long_prefill_token_threshold is not None:
        args += ["--long-prefill-token-threshold", str(engine.long_prefill_token_threshold)]
    if engine.max_waiting is not None:
        args += ["--max-waiting", str(engine.max_waiting)]
    if spec.fairness.policy != DEFAULT_SCHEDULING_POLICY:  # the same default on both sides
        args += ["--scheduling-policy", spec.fairness.policy]
    if spec.fairness.weights_argument():
        args += ["--tenant-weights", spec.fairness.weights_argument()]
    return args + parallel_args(spec)


def parallel_args(spec: InferenceServiceSpec) -> list[str]:
    """The parallelism flags of ``slipstream serve``: none for one rank;
    ``--tensor-parallel-size N`` for N ranks in one pod; with ``pipeline`` M > 1, the group's
    (one pod per stage, vLLM's multi-node names): its node rank and the leader's address from
    the environment LWS gives each pod, expanded by the kubelet (``$(VAR)``)."""
    tensor, pipeline = spec.tensor_parallel_size, spec.pipeline_parallel_size
    if pipeline == 1:
        return [TENSOR_PARALLEL_FLAG, str(tensor)] if tensor > 1 else []
    return [PIPELINE_PARALLEL_FLAG, str(pipeline), TENSOR_PARALLEL_FLAG, str(tensor),
            NNODES_FLAG, str(pipeline), NODE_RANK_FLAG, f"$({LWS_WORKER_INDEX_ENV})",
            MASTER_ADDR_FLAG, f"$({LWS_LEADER_ADDRESS_ENV})", MASTER_PORT_FLAG, str(MASTER_PORT)]


def needs_shm(spec: InferenceServiceSpec) -> bool:
    """Whether the pod gets a memory-backed ``/dev/shm``: GPU pods, and pods of several
    tensor-parallel ranks (gloo on CPU shares buffers there too)."""
    return spec.resources.gpus > 0 or spec.tensor_parallel_size > 1


def shm_size_limit(spec: InferenceServiceSpec) -> str:
    """``sizeLimit`` of the ``/dev/shm`` (:func:`needs_shm`): :data:`SHM_SIZE_LIMIT_BYTES`, or a quarter
    of ``spec.resources.memory`` if less, in whole MiB written as the API server writes it back
    (``2Gi``, ``768Mi``)."""
    mib = int(min(SHM_SIZE_LIMIT_BYTES, parse_quantity(spec.resources.memory) / 4)) >> 20
    return f"{mib >> 10}Gi" if mib and mib % 1024 == 0 else f"{max(mib, 1)}Mi"


def termination_grace_period(spec: InferenceServiceSpec) -> int:
    """Seconds from delete to SIGKILL: the preStop pause, the server's drain, a margin."""
    return PRESTOP_SLEEP_SECONDS + spec.shutdown_timeout_seconds + 10


def initial_replicas(spec: InferenceServiceSpec) -> int:
    """Replicas at creation: ``spec.replicas``, or ``minReplicas`` when the autoscaler owns it."""
    return spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas


def _container(spec: InferenceServiceSpec, name: str,
               kube_version: tuple[int, int] | None) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = {"memory": res.memory}
    if res.gpus:
        # One per tensor-parallel rank (the contract makes gpus equal tensor). Extended resources
        # are set as limits; requests default to them.
        limits["nvidia.com/gpu"] = res.gpus
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": ["slipstream"],
        "args": server_args(spec, name, kube_version),
        "ports": [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {
            # /health answers at once, /ready after load and warm-up: a load that takes longer
            # than startupTimeoutSeconds restarts the pod; liveness checks start after it.
            "httpGet": {"path": "/ready", "port": PORT_NAME},
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 2,
            "failureThreshold": math.ceil(spec.startup_timeout_seconds / PROBE_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": PORT_NAME},
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {
            # Keep serving while the pod leaves the Service's endpoints; SIGTERM then drains.
            "preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}},
        },
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    location = model_location(spec.model)
    container["env"] = server_env(spec)
    mounts = []
    if location.kind == "pvc":
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if location.downloaded:
        mounts.append({"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True})
        mounts.append({"name": MODEL_REVISION_VOLUME, "mountPath": MODEL_REVISION_MOUNT, "readOnly": True})
    if location.kind == "oci":
        mounts.append({"name": "model", "mountPath": MODEL_IMAGE_MOUNT, "readOnly": True}
                      if use_image_volume(spec.model, kube_version) else
                      {"name": "model", "mountPath": MODELCAR_LINK_MOUNT, "readOnly": True})
    if needs_shm(spec):
        mounts.append({"name": "shm", "mountPath": SHM_MOUNT})
    if mounts:
        container["volumeMounts"] = mounts
    return container


def server_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The server container's environment: ``HF_HUB_OFFLINE=1`` whatever the source (the image
    no longer sets it, so that ``docker run IMAGE serve --model hf://…`` downloads), since in a
    pod the weights are local (builtin, image, pvc, oci, sim) or already downloaded by the init
    container (hf, s3): the server never reaches the Hub. Then ``spec.env``, whose own
    ``HF_HUB_OFFLINE`` replaces the operator's. (``TRANSFORMERS_OFFLINE`` is not set: only
    huggingface_hub reads it, as a fallback that ``HF_HUB_OFFLINE`` decides over.)"""
    user = [var.manifest() for var in spec.env]
    env = [] if any(var["name"] == "HF_HUB_OFFLINE" for var in user) else [
        {"name": "HF_HUB_OFFLINE", "value": "1"}]
    return env + user


def download_args(spec: InferenceServiceSpec) -> list[str]:
    """The ``slipstream download`` argument list of the init container (hf:// and s3://)."""
    model = spec.model
    args = ["download", model_location(model).uri, "--cache-dir", MODEL_CACHE_MOUNT,
            "--termination-message-path", TERMINATION_MESSAGE_PATH, "--revision-file", MODEL_REVISION_FILE]
    if model.s3 is not None and model.s3.endpoint:
        args += ["--s3-endpoint", model.s3.endpoint]
    if model.cache is not None and model.cache.max_size is not None:
        args += ["--max-cache-bytes", str(quantity_bytes(model.cache.max_size))]
    return args


def download_container(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The init container that fetches hf:// and s3:// weights into the model cache once per
    revision (a shared cache: under a lock, the other pods wait and reuse), then exits; it
    writes the resolved revision, bytes and seconds, or the error, as its termination message
    (JSON), which the status reads, and into the pod's own :data:`MODEL_REVISION_FILE`, the
    revision the server then serves. The server's image, the user's env (proxies, HF_ENDPOINT),
    the credentials Secret; the Hub client online here only."""
    res, model = spec.resources, spec.model
    env = [{"name": "HF_HUB_OFFLINE", "value": "0"}]
    if model.s3 is not None and model.s3.region:
        env.append({"name": "AWS_REGION", "value": model.s3.region})
    env += [var.manifest() for var in spec.env if var.name != "HF_HUB_OFFLINE"]
    container: dict[str, Any] = {
        "name": DOWNLOAD_CONTAINER,
        "image": spec.image,
        "command": ["slipstream"],
        "args": download_args(spec),
        "env": env,
        # Downloads are network-bound: a fraction of the server's CPU, its memory limit.
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": res.memory}},
        "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT},
                         {"name": MODEL_REVISION_VOLUME, "mountPath": MODEL_REVISION_MOUNT}],
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if model.secret_ref is not None:
        container["envFrom"] = [{"secretRef": {"name": model.secret_ref.name}}]
    return container


def modelcar_container(location: ModelLocation) -> dict[str, Any]:
    """The modelcar (KServe's pattern, for clusters without image volumes): the model image
    runs as a native sidecar that links its ``/models`` into the shared emptyDir, through
    ``/proc/PID/root`` (the pod shares one PID namespace and one user), and sleeps; it starts,
    pulling the image, before the server, which reads through the link."""
    link = MODELCAR_LINK_MOUNT + MODEL_IMAGE_DIR
    return {
        "name": MODELCAR_CONTAINER,
        "image": location.reference,
        "restartPolicy": "Always",
        # "$$$$": the kubelet expands $(VAR) in commands and turns "$$" into "$", so the shell
        # gets "$$", its own pid (which exec keeps for sleep)
        "command": ["sh", "-c", f"ln -sfn /proc/$$$$/root{MODEL_IMAGE_DIR} {link} && exec sleep 2147483647"],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "startupProbe": {"exec": {"command": ["test", "-e", f"{link}/"]},
                         "periodSeconds": 1, "failureThreshold": 600},
        "volumeMounts": [{"name": "model", "mountPath": MODELCAR_LINK_MOUNT}],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }


def model_volumes(location: ModelLocation, spec: InferenceServiceSpec,
                  kube_version: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The pod's volumes for its weights: the claim (pvc), the model cache and the pod's own
    record of the revision its download step fetched (hf, s3), the model image or the modelcar's
    link directory (oci)."""
    if location.kind == "pvc":
        return [{"name": "model", "persistentVolumeClaim": {
            "claimName": location.claim_name, "readOnly": True}}]
    if location.kind == "oci":
        if use_image_volume(spec.model, kube_version):
            return [{"name": "model", "image": {"reference": location.reference,
                                                "pullPolicy": "IfNotPresent"}}]
        return [{"name": "model", "emptyDir": {"sizeLimit": "1Mi"}}]
    if not location.downloaded:
        return []
    cache = spec.model.cache or ModelCacheSpec()
    revision = {"name": MODEL_REVISION_VOLUME, "emptyDir": {"sizeLimit": "1Mi"}}
    if cache.claim_name is not None:
        return [{"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}, revision]
    if cache.host_path is not None:
        return [{"name": MODEL_CACHE_VOLUME, "hostPath": {"path": cache.host_path,
                                                          "type": "DirectoryOrCreate"}}, revision]
    return [{"name": MODEL_CACHE_VOLUME, "emptyDir": {}}, revision]


def render_deployment(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                      kube_version: tuple[int, int] | None = None) -> dict[str, Any]:
    """The Deployment for InferenceService ``body`` (a dict with metadata.name/namespace).
    ``kube_version`` (major, minor) of the cluster decides how a model image is mounted
    (:func:`~.model_spec.use_image_volume`; None: a current cluster).

    ``spec.replicas`` of the result is the initial count (see :func:`initial_replicas`); the
    reconcile loop leaves it alone on an existing Deployment while autoscaling is on.
    Raises SpecError (from :func:`parse_spec`) when the spec cannot be served.
    """
    meta = body.get("metadata", {})
    name, namespace = meta["name"], meta.get("namespace") or "default"
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    pod_spec: dict[str, Any] = {
        "containers": [_container(spec, name, kube_version)],
        "terminationGracePeriodSeconds": termination_grace_period(spec),
        # A Service named like an env prefix (SLIPSTREAM_…) must not leak variables into pods.
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.manifest() for t in spec.tolerations]
    location = model_location(spec.model)
    if location.kind == "oci" and kube_version is not None and kube_version < MODELCAR_SINCE:
        raise SpecError("UnsupportedCluster", f"spec.model.uri oci:// needs Kubernetes 1.29 or later (a "
                                              f"native sidecar, or an image volume from 1.35); this cluster "
                                              f"is {kube_version[0]}.{kube_version[1]}")
    if location.downloaded:
        pod_spec["initContainers"] = [download_container(spec)]
    if location.kind == "oci" and not use_image_volume(spec.model, kube_version):
        pod_spec["initContainers"] = [modelcar_container(location)]
        pod_spec["shareProcessNamespace"] = True
    volumes = model_volumes(location, spec, kube_version)
    if needs_shm(spec):
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory",
                                                    "sizeLimit": shm_size_limit(spec)}})
    if volumes:
        pod_spec["volumes"] = volumes
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name),
                     "annotations": {}},
        "spec": {
            "replicas": initial_replicas(spec),
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            # A rollout waits for model loads: give it the startup budget and then some.
            "progressDeadlineSeconds": max(600, spec.startup_timeout_seconds + 120 + (
                DOWNLOAD_BUDGET_SECONDS if location.downloaded else 0)),
            "template": {
                "metadata": {
                    "labels": labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    deployment["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = spec_hash(deployment)
    return deployment


def render_service(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                   ) -> dict[str, Any]:
    """The ClusterIP Service: port 80 (``http``) → the named port ``http`` of the gateway pods
    while ``spec.routing.enabled``, else of the model pods. Raises SpecError (parse_spec)."""
    meta = body.get("metadata", {})
    name, namespace = meta["name"], meta.get("namespace") or "default"
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    selector = gateway_selector_labels(name) if spec.routing.enabled else serving_selector_labels(name, spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": PORT_NAME, "port": SERVICE_PORT, "targetPort": PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def needs_disruption_budget(spec: InferenceServiceSpec) -> bool:
    """Whether the service can run more than one pod (``spec.replicas`` > 1, or autoscaling
    with ``maxReplicas`` > 1): only then does "at most one pod down at a time" mean anything.
    With one pod, a budget of maxUnavailable 1 allows evicting it anyway, and minAvailable 1
    would block every node drain, so a single-pod service gets none."""
    if spec.autoscaling.enabled:
        return spec.autoscaling.max_replicas > 1
    return spec.replicas > 1


def render_disruption_budget(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                             ) -> dict[str, Any] | None:
    """The PodDisruptionBudget (policy/v1): voluntary evictions (node drains, cluster
    autoscalers) take at most one model pod at a time, so the others keep serving while the
    evicted one's replacement loads its model. None when :func:`needs_disruption_budget` is
    false. Raises SpecError when the spec cannot be served."""
    meta = body.get("metadata", {})
    name, namespace = meta["name"], meta.get("namespace") or "default"
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    if not needs_disruption_budget(spec):
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def spec_hash(deployment: Mapping[str, Any]) -> str:
    """A short stable hash of what the operator renders for a Deployment, without
    ``spec.replicas`` (the autoscaler's) and without the hash annotation itself."""
    content = json.loads(json.dumps(deployment))
    content.get("spec", {}).pop("replicas", None)
    content.get("metadata", {}).get("annotations", {}).pop(SPEC_HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
