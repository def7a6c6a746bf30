"""The process kubelet (e2e/cluster/kubelet) on the real control plane: pods are scheduled by the
real kube-scheduler, their Services' EndpointSlices are written by the real controller-manager,
and each pod runs as local processes in its own network and mount namespaces.

Small pods only (a shell, or Python from the virtualenv): the whole file takes well under two
minutes.
"""
from __future__ import annotations

import json
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from cluster_helpers import condition, wait_for
from kubelet import pod_log_path

pytestmark = pytest.mark.cluster

NS = "kubelet-test"
SERVER_IMAGE = "ghcr.io/slipstream-dev/slipstream:test"  # the virtualenv's python, uid 10001
SHELL_IMAGE = "docker.io/library/busybox:1.36"            # the host's /bin/sh tools, uid 0

# GET /ready answers 503 until GET /make-ready; every answer's body is the pod's name.
HTTP_SERVER = textwrap.dedent("""
    import http.server, os
    ready = False
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            global ready
            if self.path == "/make-ready":
                ready = True
            body = os.environ["POD_NAME"].encode()
            self.send_response(503 if self.path == "/ready" and not ready else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
""")


@pytest.fixture(scope="module")
def core(cluster) -> client.CoreV1Api:
    api = client.CoreV1Api(cluster.api_client())
    if not _exists(api.read_namespace, NS):
        api.create_namespace({"metadata": {"name": NS}})
    # Pods need the namespace's default ServiceAccount and CA ConfigMap (controller-manager's).
    wait_for(lambda: _exists(api.read_namespaced_service_account, "default", NS), 30, "the default ServiceAccount")
    wait_for(lambda: _exists(api.read_namespaced_config_map, "kube-root-ca.crt", NS), 30, "kube-root-ca.crt")
    return api


def _exists(read, *args) -> bool:
    try:
        read(*args)
        return True
    except client.ApiException as err:
        if err.status == 404:
            return False
        raise


def _ignore_missing(call, *args) -> None:
    try:
        call(*args)
    except client.ApiException as err:
        if err.status != 404:
            raise


def pod_manifest(name: str, containers: list[dict], **spec) -> dict:
    spec.setdefault("terminationGracePeriodSeconds", 2)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
            "spec": {"containers": containers, **spec}}


def create(core: client.CoreV1Api, manifest: dict) -> dict:
    """Creates the pod (after removing one of that name an earlier run left)."""
    name = manifest["metadata"]["name"]
    if read(core, name):
        delete(core, name)
        wait_for(lambda: read(core, name) is None, 30, f"the old pod {name} to go")
    core.create_namespaced_pod(NS, manifest)
    return read(core, manifest["metadata"]["name"])


def read(core: client.CoreV1Api, name: str) -> dict | None:
    try:
        return json.loads(core.read_namespaced_pod(name, NS, _preload_content=False).data)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def wait_pod(core, name: str, check, what: str, timeout: float = 30) -> dict:
    return wait_for(lambda: (p := read(core, name)) and check(p) and p, timeout, f"pod {name}: {what}", 0.3)


def phase_is(*phases: str):
    return lambda p: p.get("status", {}).get("phase") in phases


def container_status(pod: dict, name: str | None = None) -> dict:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return next((s for s in statuses if name is None or s.get("name") == name), {})


def log_of(cluster, pod: dict, container: str, restart: int = 0) -> str:
    m = pod["metadata"]
    return pod_log_path(cluster.state_dir, m["namespace"], m["name"], m["uid"], container, restart).read_text()


def events_of(core, name: str) -> list[dict]:
    items = json.loads(core.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}",
                                                  _preload_content=False).data)["items"]
    return items


def delete(core, name: str, grace: int | None = 0) -> None:
    try:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=grace)
    except client.ApiException as err:
        if err.status != 404:
            raise


def node_address(core) -> str:
    """The node's InternalIP: the pod network's gateway, where the kubelet relays to the API."""
    node = core.read_node("node-1")
    return next(a.address for a in node.status.addresses if a.type == "InternalIP")


def http_get(ip: str, path: str = "/") -> tuple[int, str]:
    """GET http://IP:8080/PATH: (status, body); raises OSError when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=3) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def http_container(**extra) -> dict:
    return {"name": "web", "image": SERVER_IMAGE, "command": ["python", "-c", HTTP_SERVER],
            "ports": [{"name": "http", "containerPort": 8080}],
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}], **extra}


def test_each_pod_has_its_own_address_where_a_server_on_0_0_0_0_is_reachable_from_the_host(core):
    names = ["same-port-a", "same-port-b"]
    for name in names:
        create(core, pod_manifest(name, [http_container()]))
    pods = [wait_pod(core, n, lambda p: p["status"].get("podIP") and container_status(p).get("ready"), "ready")
            for n in names]
    ips = [p["status"]["podIP"] for p in pods]
    gateway = node_address(core)
    assert len(set(ips)) == 2 and all(ip.rsplit(".", 1)[0] == gateway.rsplit(".", 1)[0] for ip in ips)
    for pod, name in zip(pods, names):
        assert wait_for(lambda: http_get(pod["status"]["podIP"]) == (200, name), 10, f"{name} answering")
        assert pod["status"]["phase"] == "Running"
        assert pod["status"]["hostIP"] == gateway
        assert pod["status"]["podIPs"] == [{"ip": pod["status"]["podIP"]}]
        assert container_status(pod)["state"]["running"]["startedAt"]
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}.items() >= {
            "PodScheduled": "True", "Initialized": "True", "ContainersReady": "True", "Ready": "True"}.items()
    for name in names:
        delete(core, name)


def test_readiness_drives_ready_and_the_services_endpointslice(cluster, core):
    name = "readiness"
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}
    create(core, pod_manifest(name, [http_container(readinessProbe=probe)]))
    if _exists(core.read_namespaced_service, name, NS):
        core.delete_namespaced_service(name, NS)
    core.create_namespaced_service(NS, {"metadata": {"name": name}, "spec": {
        "selector": {"app": name}, "ports": [{"port": 80, "targetPort": 8080}]}})
    discovery = client.DiscoveryV1Api(cluster.api_client())

    def endpoints() -> list[dict]:
        slices = discovery.list_namespaced_endpoint_slice(NS, label_selector=f"kubernetes.io/service-name={name}")
        return [{"ip": e.addresses[0], "ready": e.conditions.ready} for s in slices.items for e in s.endpoints or []]

    pod = wait_pod(core, name, lambda p: container_status(p).get("started"), "started")
    ip = pod["status"]["podIP"]
    assert wait_for(lambda: endpoints() == [{"ip": ip, "ready": False}], 20, "a not-ready endpoint")
    pod = read(core, name)
    assert condition(pod, "Ready")["status"] == "False"
    assert condition(pod, "Ready")["reason"] == "ContainersNotReady"
    assert wait_for(lambda: http_get(ip, "/make-ready") == (200, name), 10, "the server to answer")
    pod = wait_pod(core, name, lambda p: condition(p, "Ready")["status"] == "True", "Ready")
    assert container_status(pod)["ready"] is True
    assert wait_for(lambda: endpoints() == [{"ip": ip, "ready": True}], 20, "a ready endpoint")
    core.delete_namespaced_service(name, NS)
    delete(core, name)


def test_the_serviceaccount_token_authenticates_as_the_pods_serviceaccount(cluster, core):
    if not _exists(core.read_namespaced_service_account, "reader", NS):
        core.create_namespaced_service_account(NS, {"metadata": {"name": "reader"}})
    whoami = textwrap.dedent("""
        import json, os, ssl, urllib.request
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        token = open(f"{sa}/token").read()
        url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        request = urllib.request.Request(
            url + "/apis/authentication.k8s.io/v1/selfsubjectreviews", method="POST",
            data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        context = ssl.create_default_context(cafile=f"{sa}/ca.crt")
        review = json.load(urllib.request.urlopen(request, context=context, timeout=10))
        print("user", review["status"]["userInfo"]["username"])
        print("namespace", open(f"{sa}/namespace").read())
    """)
    pod = create(core, pod_manifest("whoami", [{"name": "c", "image": SERVER_IMAGE, "command": ["python", "-c", whoami]}],
                                    serviceAccountName="reader", restartPolicy="Never"))
    pod = wait_pod(core, "whoami", phase_is("Succeeded", "Failed"), "finished")
    log = log_of(cluster, pod, "c")
    assert pod["status"]["phase"] == "Succeeded", log
    assert f"user system:serviceaccount:{NS}:reader" in log
    assert f"namespace {NS}" in log
    assert container_status(pod)["state"]["terminated"]["reason"] == "Completed"
    delete(core, "whoami")


def test_volumes_env_and_init_containers_in_order(cluster, core):
    delete(core, "volumes")
    for remove, *args in ((core.delete_namespaced_config_map, "cfg", NS), (core.delete_namespaced_secret, "sec", NS),
                          (core.delete_namespaced_persistent_volume_claim, "data", NS),
                          (core.delete_persistent_volume, "kubelet-test-pv")):
        _ignore_missing(remove, *args)
    wait_for(lambda: not _exists(core.read_persistent_volume, "kubelet-test-pv"), 30, "the old PV to go")
    core.create_namespaced_config_map(NS, {"metadata": {"name": "cfg"}, "data": {"a": "alpha", "b": "beta"}})
    core.create_namespaced_secret(NS, {"metadata": {"name": "sec"}, "stringData": {"password": "hunter2"}})
    host_dir = tempfile.mkdtemp(prefix="kubelet-pv-")
    Path(host_dir).chmod(0o777)
    core.create_persistent_volume({"metadata": {"name": "kubelet-test-pv"}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
        "hostPath": {"path": host_dir}, "persistentVolumeReclaimPolicy": "Retain"}})
    core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": "kubelet-test-pv",
        "resources": {"requests": {"storage": "1Gi"}}}})
    init = [{"name": n, "image": SHELL_IMAGE, "command": ["sh", "-c", f"echo {n} >> /scratch/order"],
             "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]} for n in ("first", "second")]
    script = textwrap.dedent("""
        import os, stat
        def show(path): print(path, repr(open(path).read()), oct(stat.S_IMODE(os.stat(path).st_mode)))
        show("/scratch/order"); show("/etc/cfg/renamed"); show("/etc/sec/password")
        print("env", os.environ["MY_NAME"], os.environ["MY_NS"], os.environ["MY_IP"], os.environ["APP"],
              os.environ["CFG_a"], os.environ["PASSWORD"])
        print("argv", os.environ["GREETING"])
        open("/data/out", "w").write("persisted")
        try:
            open("/data-ro/out2", "w")
        except OSError as err:
            print("read-only", err.errno)
        print("memory", [l.split()[2] for l in open("/proc/self/mounts") if " /shm " in l])
        print("labels", open("/podinfo/labels").read())
        print("tmp", os.listdir("/tmp"), "uid", os.getuid())
    """)
    env = [{"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
           {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
           {"name": "MISSING", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "x", "optional": True}}},
           {"name": "GREETING", "value": "hello $(MY_NAME)"}]
    mounts = [{"name": "scratch", "mountPath": "/scratch"}, {"name": "cfg", "mountPath": "/etc/cfg"},
              {"name": "sec", "mountPath": "/etc/sec"}, {"name": "data", "mountPath": "/data"},
              {"name": "data", "mountPath": "/data-ro", "readOnly": True}, {"name": "shm", "mountPath": "/shm"},
              {"name": "podinfo", "mountPath": "/podinfo"}]
    volumes = [{"name": "scratch", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}},
               {"name": "cfg", "configMap": {"name": "cfg", "items": [{"key": "a", "path": "renamed"}],
                                             "defaultMode": 0o640}},
               {"name": "sec", "secret": {"secretName": "sec"}},
               {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
               {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels",
                                                              "fieldRef": {"fieldPath": "metadata.labels"}}]}}]
    app = {"name": "app", "image": SERVER_IMAGE, "command": ["python", "-c", script], "env": env,
           "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}], "volumeMounts": mounts}
    pod = create(core, pod_manifest("volumes", [app], initContainers=init, volumes=volumes, restartPolicy="Never",
                                    securityContext={"fsGroup": 10001}))
    pod = wait_pod(core, "volumes", phase_is("Succeeded", "Failed"), "finished", timeout=40)
    log = log_of(cluster, pod, "app")
    assert pod["status"]["phase"] == "Succeeded", log
    ip = pod["status"]["podIP"]
    assert "/scratch/order 'first\\nsecond\\n'" in log
    assert "/etc/cfg/renamed 'alpha' 0o640" in log
    assert "/etc/sec/password 'hunter2' 0o644" in log
    assert f"env volumes {NS} {ip} volumes alpha hunter2" in log
    assert "argv hello volumes" in log
    assert "read-only 30" in log  # EROFS
    assert "memory ['tmpfs']" in log
    assert 'labels app="volumes"' in log
    # A private /tmp: nothing of the host's but the way to this checkout when it lies under /tmp.
    repo = Path(__file__).resolve().parents[2]
    shown = [repo.parts[2]] if repo.parts[1] == "tmp" else []
    assert f"tmp {shown} uid 10001" in log
    assert (Path(host_dir) / "out").read_text() == "persisted"
    assert [s["state"]["terminated"]["exitCode"] for s in pod["status"]["initContainerStatuses"]] == [0, 0]
    delete(core, "volumes")
    core.delete_namespaced_persistent_volume_claim("data", NS)
    core.delete_persistent_volume("kubelet-test-pv")


def test_a_failing_liveness_probe_restarts_the_container_with_back_off(core):
    liveness = {"exec": {"command": ["test", "-f", "/tmp/healthy"]}, "periodSeconds": 1, "failureThreshold": 1}
    create(core, pod_manifest("liveness", [{"name": "c", "image": SHELL_IMAGE, "command": ["sleep", "3600"],
                                            "livenessProbe": liveness}]))
    pod = wait_pod(core, "liveness", lambda p: container_status(p).get("state", {}).get("waiting", {}).get("reason")
                   == "CrashLoopBackOff", "CrashLoopBackOff", timeout=30)
    status = container_status(pod)
    assert status["restartCount"] >= 1
    assert status["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM
    assert "back-off 10s restarting failed container=c" in status["state"]["waiting"]["message"]
    assert pod["status"]["phase"] == "Running"
    reasons = {(e["reason"], e["message"]) for e in events_of(core, "liveness")}
    assert ("Killing", "Container c failed liveness probe, will be restarted") in reasons
    assert any(r == "Unhealthy" and m.startswith("Liveness probe failed") for r, m in reasons)
    assert any(r == "BackOff" for r, _ in reasons)
    delete(core, "liveness")


def test_an_image_not_in_the_table_fails_to_pull(core):
    create(core, pod_manifest("foreign", [{"name": "c", "image": "nginx:1.27"}]))
    pod = wait_pod(core, "foreign", lambda p: container_status(p).get("state", {}).get("waiting", {}).get("reason")
                   in ("ErrImagePull", "ImagePullBackOff"), "ErrImagePull")
    waiting = container_status(pod)["state"]["waiting"]
    assert 'failed to pull and unpack image "docker.io/library/nginx:1.27"' in waiting["message"]
    assert "not found" in waiting["message"]
    assert pod["status"]["phase"] == "Pending"
    failed = wait_for(lambda: [e for e in events_of(core, "foreign") if e["reason"] == "Failed"], 10, "a Failed event")
    assert failed[0]["type"] == "Warning" and failed[0]["source"] == {"component": "kubelet", "host": "node-1"}
    delete(core, "foreign")


def test_run_as_non_root_with_a_root_image_is_a_config_error(core):
    create(core, pod_manifest("rootless", [{"name": "c", "image": SHELL_IMAGE, "command": ["true"],
                                            "securityContext": {"runAsNonRoot": True}}]))
    pod = wait_pod(core, "rootless", lambda p: container_status(p).get("state", {}).get("waiting", {}).get("reason")
                   == "CreateContainerConfigError", "CreateContainerConfigError")
    assert container_status(pod)["state"]["waiting"]["message"].startswith(
        "container has runAsNonRoot and image will run as root")
    delete(core, "rootless")


def test_deletion_runs_prestop_then_sigterm_and_kills_after_the_grace_period(core):
    record = Path(tempfile.mkdtemp(prefix="kubelet-record-"))
    record.chmod(0o777)
    stubborn = textwrap.dedent("""
        import signal, time
        def on_term(*_):
            open("/record/log", "a").write(f"term {time.time()}\\n")
        signal.signal(signal.SIGTERM, on_term)
        open("/record/log", "a").write("started\\n")
        while True:
            time.sleep(0.1)
    """)
    prestop = {"exec": {"command": ["sh", "-c", 'echo "prestop $(date +%s.%N)" >> /record/log; sleep 1']}}
    create(core, pod_manifest("graceful", [{
        "name": "c", "image": SERVER_IMAGE, "command": ["python", "-c", stubborn], "lifecycle": {"preStop": prestop},
        "volumeMounts": [{"name": "record", "mountPath": "/record"}]}],
        terminationGracePeriodSeconds=3, volumes=[{"name": "record", "hostPath": {"path": str(record)}}]))
    wait_pod(core, "graceful", phase_is("Running"), "Running")
    wait_for(lambda: "started" in (record / "log").read_text(), 10, "the process to start")
    began = time.time()
    core.delete_namespaced_pod("graceful", NS)
    wait_for(lambda: read(core, "graceful") is None, 20, "the pod to be removed", 0.2)
    took = time.time() - began
    lines = (record / "log").read_text().split("\n")
    prestop_at = next(float(l.split()[1]) for l in lines if l.startswith("prestop"))
    term_at = next(float(l.split()[1]) for l in lines if l.startswith("term"))
    assert began < prestop_at < term_at - 0.9  # the hook ran, then SIGTERM after it
    assert 3 <= took < 8  # SIGKILL at the end of the 3 s grace period, which includes the hook


def test_a_gpu_pod_on_a_node_without_gpus_stays_pending_as_the_scheduler_says(core):
    create(core, pod_manifest("gpu", [{"name": "c", "image": SERVER_IMAGE,
                                       "resources": {"limits": {"nvidia.com/gpu": "1"}}}]))
    pod = wait_pod(core, "gpu", lambda p: (condition(p, "PodScheduled") or {}).get("status") == "False", "unschedulable")
    scheduled = condition(pod, "PodScheduled")
    assert scheduled["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    delete(core, "gpu")


def test_a_sidecar_starts_before_the_app_restarts_when_it_exits_and_stops_after_the_app(cluster, core):
    record = Path(tempfile.mkdtemp(prefix="kubelet-sidecar-"))
    record.chmod(0o777)
    # First run: ready after 2 s, exits 3 after 3 more; later runs: ready at once, log SIGTERM.
    side = textwrap.dedent("""
        if [ ! -f /shared/ran ]; then
            touch /shared/ran; sleep 2; touch /shared/ready; sleep 3; exit 3
        fi
        trap 'echo "side-term $(date +%s.%N)" >> /record/log; exit 0' TERM
        touch /shared/ready
        while true; do sleep 0.1; done
    """)
    app = textwrap.dedent("""
        test -f /shared/ready || { echo "app-before-sidecar" >> /record/log; exit 1; }
        echo "app-start" >> /record/log
        trap 'echo "app-term $(date +%s.%N)" >> /record/log; sleep 1; echo "app-exit $(date +%s.%N)" >> /record/log; exit 0' TERM
        while true; do sleep 0.1; done
    """)
    mounts = [{"name": "shared", "mountPath": "/shared"}, {"name": "record", "mountPath": "/record"}]
    sidecar = {"name": "side", "image": SHELL_IMAGE, "restartPolicy": "Always", "command": ["sh", "-c", side],
               "startupProbe": {"exec": {"command": ["test", "-f", "/shared/ready"]}, "periodSeconds": 1,
                                "failureThreshold": 30},
               "volumeMounts": mounts}
    create(core, pod_manifest("sidecar", [{"name": "app", "image": SHELL_IMAGE, "command": ["sh", "-c", app],
                                           "volumeMounts": mounts}],
                              initContainers=[sidecar], terminationGracePeriodSeconds=5,
                              volumes=[{"name": "shared", "emptyDir": {}},
                                       {"name": "record", "hostPath": {"path": str(record)}}]))
    pod = wait_pod(core, "sidecar", lambda p: condition(p, "Initialized")["status"] == "True", "Initialized")
    [side_status] = pod["status"]["initContainerStatuses"]
    assert side_status["started"] is True and "running" in side_status["state"], side_status
    pod = wait_pod(core, "sidecar", lambda p: p["status"]["initContainerStatuses"][0]["restartCount"] >= 1
                   and p["status"]["initContainerStatuses"][0]["started"] and condition(p, "Ready")["status"] == "True",
                   "the sidecar restarted and Ready", timeout=30)
    [side_status] = pod["status"]["initContainerStatuses"]
    assert side_status["lastState"]["terminated"]["exitCode"] == 3
    assert "running" in side_status["state"] and side_status["ready"] is True
    assert container_status(pod, "app")["restartCount"] == 0 and "running" in container_status(pod, "app")["state"]
    assert pod["status"]["phase"] == "Running"
    assert (record / "log").read_text() == "app-start\n"  # the app found the sidecar's file

    began = time.time()
    core.delete_namespaced_pod("sidecar", NS)
    wait_for(lambda: read(core, "sidecar") is None, 20, "the pod to be removed", 0.2)
    lines = dict(line.split() for line in (record / "log").read_text().splitlines()[1:])
    assert set(lines) == {"app-term", "app-exit", "side-term"}, lines
    assert began < float(lines["app-term"]) < float(lines["app-exit"]) < float(lines["side-term"]) < began + 5


def test_a_pod_completes_when_its_app_container_does_and_its_sidecar_is_stopped(core):
    sidecar = {"name": "side", "image": SHELL_IMAGE, "restartPolicy": "Always", "command": ["sleep", "3600"]}
    create(core, pod_manifest("sidecar-done", [{"name": "app", "image": SHELL_IMAGE, "command": ["sleep", "1"]}],
                              initContainers=[sidecar], restartPolicy="Never"))
    pod = wait_pod(core, "sidecar-done", phase_is("Succeeded", "Failed"), "finished", timeout=30)
    assert pod["status"]["phase"] == "Succeeded"
    [side_status] = pod["status"]["initContainerStatuses"]
    assert side_status["state"]["terminated"]["exitCode"] == 143, side_status  # SIGTERM
    assert container_status(pod, "app")["state"]["terminated"]["exitCode"] == 0
    delete(core, "sidecar-done")


NAME_LOOKUPS = textwrap.dedent("""
    import socket, time
    for _ in range(150):  # until the EndpointSlice controller lists alpha and the kubelet hears of it
        try:
            print("short", socket.gethostbyname("alpha.names"), flush=True)
            break
        except OSError:
            time.sleep(0.2)
    print("fqdn", socket.gethostbyname("alpha.names.kubelet-test.svc.cluster.local"))
    print("self", socket.gethostname(), socket.gethostbyname(socket.gethostname()))
    began = time.monotonic()
    try:
        socket.gethostbyname("nowhere.example")
    except OSError:
        print("unknown", round(time.monotonic() - began, 1), flush=True)
    time.sleep(3600)
""")


def test_a_pod_behind_a_headless_service_is_found_by_hostname_and_subdomain_from_another_pod(cluster, core):
    """What cluster DNS answers for a pod with hostname + subdomain naming a headless Service
    (how a LeaderWorkerSet's workers reach their leader): the kubelet's /etc/hosts has it under
    the names the search list reaches, a pod's own hostname resolves to its IP, and a name no
    record has fails at once."""
    service = "names"
    if _exists(core.read_namespaced_service, service, NS):
        core.delete_namespaced_service(service, NS)
    core.create_namespaced_service(NS, {"metadata": {"name": service}, "spec": {
        "clusterIP": "None", "selector": {"app": "names-a"}, "ports": [{"port": 80}]}})
    create(core, pod_manifest("names-a", [{"name": "c", "image": SHELL_IMAGE, "command": ["sleep", "3600"]}],
                              hostname="alpha", subdomain=service))
    create(core, pod_manifest("names-b", [{"name": "c", "image": SERVER_IMAGE,
                                           "command": ["python", "-c", NAME_LOOKUPS]}]))
    a = wait_pod(core, "names-a", lambda p: p["status"].get("podIP") and container_status(p).get("ready"), "ready")
    b = wait_pod(core, "names-b", lambda p: p["status"].get("podIP") and container_status(p).get("ready"), "ready")
    out = wait_for(lambda: "unknown" in (t := log_of(cluster, b, "c")) and t, 60, "the lookups' output")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["short"] == a["status"]["podIP"] and lines["fqdn"] == a["status"]["podIP"], out
    assert lines["self"] == f"names-b {b['status']['podIP']}", out
    assert float(lines["unknown"]) < 2.0, out
    for name in ("names-a", "names-b"):
        delete(core, name)
    core.delete_namespaced_service(service, NS)


# ---- the kubelet's pure parts (no cluster needed) ----------------------------------------------

def test_a_headless_record_is_listed_under_every_name_the_pods_search_list_completes_to_it():
    from kubelet.names import hosts_file, names_for, records_from_slices
    fqdn = "lead-0.lead-0.ns.svc.cluster.local"
    assert names_for(fqdn, "ns") == [fqdn, "lead-0.lead-0.ns.svc", "lead-0.lead-0.ns", "lead-0.lead-0"]
    assert names_for(fqdn, "other") == [fqdn, "lead-0.lead-0.ns.svc", "lead-0.lead-0.ns"]
    records = records_from_slices([{
        "metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": "lead-0"}},
        "endpoints": [{"addresses": ["10.244.0.4"], "hostname": "lead-0", "conditions": {"ready": True}},
                      {"addresses": ["10.244.0.5"], "hostname": "lead-0-1", "conditions": {"ready": False}},
                      {"addresses": ["10.244.0.6"]}]}])
    assert records == {fqdn: "10.244.0.4"}
    worker = {"metadata": {"name": "lead-0-1", "namespace": "ns"},
              "spec": {"hostname": "lead-0-1", "subdomain": "lead-0"}}
    lines = hosts_file(worker, "10.244.0.5", records).splitlines()
    assert "10.244.0.5\tlead-0-1.lead-0.ns.svc.cluster.local\tlead-0-1" in lines
    assert f"10.244.0.4\t{fqdn}\tlead-0.lead-0.ns.svc\tlead-0.lead-0.ns\tlead-0.lead-0" in lines


def test_dollar_paren_expansion_follows_kubernetes():
    from kubelet.env import expand
    assert expand("$(A)-$(B)-$$(A)-$(A", {"A": "x"}) == "x-$(B)-$(A)-$(A"


def test_image_references_are_named_as_the_container_runtime_names_them():
    from kubelet.images import normalize
    assert normalize("busybox") == "docker.io/library/busybox:latest"
    assert normalize("bitnami/redis:7") == "docker.io/bitnami/redis:7"
    assert normalize("ghcr.io/slipstream-dev/slipstream:0.1.0") == "ghcr.io/slipstream-dev/slipstream:0.1.0"
    assert normalize("localhost:5000/x") == "localhost:5000/x:latest"


def test_a_container_waiting_to_restart_keeps_its_pod_running_as_getphase_says():
    from kubelet.status import ContainerView, phase
    crashed = ContainerView("c", "i", state={"waiting": {"reason": "CrashLoopBackOff"}},
                            last_state={"terminated": {"exitCode": 1}})
    creating = ContainerView("c", "i")
    done = ContainerView("c", "i", state={"terminated": {"exitCode": 0}})
    failed = ContainerView("c", "i", state={"terminated": {"exitCode": 2}})
    assert phase("Always", [], [crashed], False) == "Running"
    assert phase("Always", [], [creating], False) == "Pending"
    assert phase("Never", [], [done], False) == "Succeeded"
    assert phase("Never", [], [done, failed], False) == "Failed"
    assert phase("OnFailure", [], [failed], False) == "Running"
    assert phase("Always", [failed], [creating], False) == "Pending"


def test_a_sidecar_not_yet_started_keeps_the_pod_pending_and_uninitialized():
    from kubelet.status import ContainerView, conditions, phase
    pod = {"spec": {}, "status": {}}
    side = ContainerView("side", "i", state={"running": {}}, sidecar=True)
    app = ContainerView("app", "i", state={"waiting": {"reason": "PodInitializing"}})
    assert phase("Always", [side], [app], False) == "Pending"
    initialized = {c["type"]: c for c in conditions(pod, "Pending", True, [side], [app])}["Initialized"]
    assert initialized["status"] == "False"
    assert initialized["message"] == "containers with incomplete status: [side]"
    side.started = True
    assert {c["type"]: c for c in conditions(pod, "Pending", True, [side], [app])}["Initialized"]["status"] == "True"


def test_a_sidecars_readiness_counts_toward_containers_ready():
    from kubelet.status import ContainerView, conditions
    side = ContainerView("side", "i", state={"running": {}}, started=True, sidecar=True)
    app = ContainerView("app", "i", state={"running": {}}, started=True, ready=True)
    done = ContainerView("init", "i", state={"terminated": {"exitCode": 0}})
    ready = {c["type"]: c for c in conditions({"spec": {}}, "Running", True, [done, side], [app])}
    assert ready["ContainersReady"]["status"] == "False"
    assert ready["ContainersReady"]["message"] == "containers with unready status: [side]"
    side.ready = True
    ready = {c["type"]: c for c in conditions({"spec": {}}, "Running", True, [done, side], [app])}
    assert ready["ContainersReady"]["status"] == ready["Ready"]["status"] == "True"


def test_a_running_sidecar_keeps_the_pod_running_and_a_stopped_one_counts_for_nothing():
    from kubelet.status import ContainerView, phase
    done = ContainerView("app", "i", state={"terminated": {"exitCode": 0}})
    running = ContainerView("side", "i", state={"running": {}}, started=True, sidecar=True)
    stopped = ContainerView("side", "i", state={"terminated": {"exitCode": 143}}, sidecar=True)
    restarting = ContainerView("side", "i", state={"waiting": {"reason": "CrashLoopBackOff"}},
                               last_state={"terminated": {"exitCode": 1}}, sidecar=True)
    assert phase("Never", [running], [done], False) == "Running"
    assert phase("Never", [stopped], [done], False) == "Succeeded"
    assert phase("OnFailure", [restarting], [done], False) == "Succeeded"
    # Once an app container ran, a sidecar restarting (not yet started again) leaves the pod Running.
    app = ContainerView("app", "i", state={"running": {}})
    assert phase("Always", [ContainerView("side", "i", state={"running": {}}, sidecar=True)], [app], False) == "Running"


def test_a_pulled_images_top_level_directories_that_the_host_lacks_are_bound(tmp_path):
    from kubelet.container import image_dirs
    from kubelet.images import Image
    missing = f"slipstream-test-{tmp_path.name}"
    for name in (missing, "usr", "etc"):
        (tmp_path / name).mkdir()
    (tmp_path / "file").write_text("not a directory")
    image = Image("127.0.0.1:5000/m:1", "127.0.0.1:5000/m@sha256:0", [], ["sh"], files=tmp_path)
    assert image_dirs(image) == [tmp_path / missing]
    assert image_dirs(Image("docker.io/library/busybox:1", "x", [], ["sh"])) == []
