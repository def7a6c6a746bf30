#!/usr/bin/env bash
# End to end on a kind cluster: the story a user follows, checked step by step.
#
#   e2e/run.sh
#
# 1. create a kind cluster            6. chat completions through a port-forward, and /metrics
# 2. build the server and operator    7. load from inside the cluster until the autoscaler adds
#    images, load them into kind         a replica
# 3. helm install charts/slipstream   8. stop the load; the autoscaler removes it again
# 4. apply the autoscaled CPU example 9. delete the example, helm uninstall, delete the CRDs:
# 5. wait until it is Ready              nothing of slipstream is left
#
# Needs docker (a running engine), kind, kubectl, helm and curl. Without them it prints SKIP and
# exits 0 (E2E_REQUIRED=1: exits 1 instead, for CI jobs that must run it).
# Settings (environment): E2E_CLUSTER (slipstream-e2e), E2E_KEEP_CLUSTER=1 (keep it afterwards;
# an existing cluster of that name is reused), E2E_NAMESPACE (e2e), E2E_PORT (18080),
# E2E_KIND_IMAGE (kind's default node image), E2E_SCALE_TIMEOUT (600 s, each way).
set -Eeuo pipefail

ROOT=$(cd "${BASH_SOURCE[0]%/*}/.." && pwd)
CLUSTER=${E2E_CLUSTER:-slipstream-e2e}
NAMESPACE=${E2E_NAMESPACE:-e2e}
RELEASE=slipstream
OPERATOR_NAMESPACE=slipstream-system
PORT=${E2E_PORT:-18080}
SCALE_TIMEOUT=${E2E_SCALE_TIMEOUT:-600}
ISVC=chat                      # metadata.name in examples/inferenceservice-autoscaling.yaml
MODEL=chat-small               # its spec.model.servedModelName
EXAMPLE=examples/inferenceservice-autoscaling.yaml
PORT_FORWARD_PID=""
CREATED_CLUSTER=0

step() { printf '\n==> %s\n' "$*"; }
say() { printf '    %s\n' "$*"; }
run() { printf '    $ %s\n' "$*"; "$@"; }

skip() {
    printf 'SKIP: %s\n' "$*"
    if [[ ${E2E_REQUIRED:-0} == 1 ]]; then
        printf 'E2E_REQUIRED=1: failing instead of skipping\n'
        exit 1
    fi
    exit 0
}

# Only shell builtins until the tools are known to be there.
missing=()
for tool in docker kind kubectl helm curl; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    skip "e2e needs ${missing[*]} on PATH (https://kind.sigs.k8s.io/docs/user/quick-start/)"
fi
if ! docker info >/dev/null 2>&1; then
    skip "docker is installed but its engine does not answer (docker info failed)"
fi

VERSION=""
while IFS= read -r line; do
    if [[ $line =~ ^version\ =\ \"([^\"]+)\" ]]; then
        VERSION=${BASH_REMATCH[1]}
        break
    fi
done <"$ROOT/pyproject.toml"
[[ -n $VERSION ]] || { echo "cannot read the version from pyproject.toml" >&2; exit 1; }
# The operator's default spec.image (operator/spec.py, the CRD) and the chart's operator image.
SERVER_IMAGE=ghcr.io/slipstream-dev/slipstream:$VERSION
OPERATOR_IMAGE=ghcr.io/slipstream-dev/slipstream-operator:$VERSION
KUBECTL=(kubectl --context "kind-$CLUSTER")
HELM=(helm --kube-context "kind-$CLUSTER")

cleanup() {
    local status=$?
    if [[ -n $PORT_FORWARD_PID ]]; then
        kill "$PORT_FORWARD_PID" 2>/dev/null || true
    fi
    if ((status != 0)); then
        step "FAILED (exit $status): what the cluster looked like"
        "${KUBECTL[@]}" get infsvc,deploy,pods,svc -A -o wide 2>/dev/null || true
        "${KUBECTL[@]}" -n "$NAMESPACE" describe infsvc "$ISVC" 2>/dev/null | tail -n 30 || true
        "${KUBECTL[@]}" -n "$OPERATOR_NAMESPACE" logs "deploy/$RELEASE-operator" --tail=80 \
            2>/dev/null || true
    fi
    if [[ ${E2E_KEEP_CLUSTER:-0} == 1 ]]; then
        say "keeping cluster $CLUSTER (kind delete cluster --name $CLUSTER to remove it)"
    elif ((CREATED_CLUSTER)); then
        step "Deleting kind cluster $CLUSTER"
        kind delete cluster --name "$CLUSTER" || true
    fi
}
trap cleanup EXIT

# wait_until TIMEOUT DESCRIPTION COMMAND...: run COMMAND every 5 s until it succeeds.
wait_until() {
    local timeout=$1 what=$2 start=$SECONDS
    shift 2
    say "waiting up to ${timeout}s until $what"
    until "$@"; do
        if ((SECONDS - start >= timeout)); then
            echo "timed out after ${timeout}s waiting until $what" >&2
            return 1
        fi
        sleep 5
    done
    say "$what (after $((SECONDS - start))s)"
}

replicas() {
    "${KUBECTL[@]}" -n "$NAMESPACE" get deploy "$ISVC" -o 'jsonpath={.spec.replicas}' 2>/dev/null \
        || echo 0
}

show_scaling() {
    "${KUBECTL[@]}" -n "$NAMESPACE" get infsvc "$ISVC" --no-headers | sed 's/^/    /'
}

replicas_at_least() { show_scaling; (($(replicas) >= $1)); }
replicas_at_most() { show_scaling; (($(replicas) <= $1)); }

step "1/9 kind cluster $CLUSTER"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    say "reusing the existing cluster"
else
    run kind create cluster --name "$CLUSTER" --wait 180s ${E2E_KIND_IMAGE:+--image "$E2E_KIND_IMAGE"}
    CREATED_CLUSTER=1
fi

step "2/9 Building the images and loading them into kind"
run docker build -f "$ROOT/docker/server.Dockerfile" -t "$SERVER_IMAGE" "$ROOT"
run docker build -f "$ROOT/docker/operator.Dockerfile" -t "$OPERATOR_IMAGE" "$ROOT"
run kind load docker-image --name "$CLUSTER" "$SERVER_IMAGE" "$OPERATOR_IMAGE"

step "3/9 helm install $RELEASE (cluster-wide operator in $OPERATOR_NAMESPACE)"
run "${HELM[@]}" upgrade --install "$RELEASE" "$ROOT/charts/slipstream" --namespace "$OPERATOR_NAMESPACE" \
    --create-namespace --wait --timeout 5m
run "${KUBECTL[@]}" -n "$OPERATOR_NAMESPACE" rollout status "deploy/$RELEASE-operator" \
    --timeout 2m
run "${KUBECTL[@]}" get crd inferenceservices.slipstream.dev

step "4/9 Applying $EXAMPLE (CPU, built-in model), sized for a kind node"
"${KUBECTL[@]}" create namespace "$NAMESPACE" --dry-run=client -o yaml \
    | run "${KUBECTL[@]}" apply -f -
# Smaller pods than the example's, a low queue target and short windows, so one laptop can show
# a scale-up and a scale-down within minutes.
SIZE_PATCH='{"spec": {"resources": {"cpu": "500m", "memory": "2Gi"},
  "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 256, "kvCacheMemory": "256Mi"},
  "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 1,
                  "stableWindowSeconds": 30, "panicWindowSeconds": 6,
                  "scaleDownDelaySeconds": 30}}}'
say "patch: $(tr -s ' \n' ' ' <<<"$SIZE_PATCH")"
"${KUBECTL[@]}" patch --local -f "$ROOT/$EXAMPLE" --type merge -p "$SIZE_PATCH" -o yaml \
    | run "${KUBECTL[@]}" -n "$NAMESPACE" apply -f -

step "5/9 Waiting until InferenceService $ISVC is Ready (model loaded and warmed)"
run "${KUBECTL[@]}" -n "$NAMESPACE" wait --for=condition=Ready "infsvc/$ISVC" --timeout=10m
run "${KUBECTL[@]}" -n "$NAMESPACE" get infsvc,deploy,svc,pods

step "6/9 Chat completions through kubectl port-forward svc/$ISVC $PORT:80"
"${KUBECTL[@]}" -n "$NAMESPACE" port-forward "svc/$ISVC" "$PORT:80" >/dev/null 2>&1 &
PORT_FORWARD_PID=$!
wait_until 60 "the port-forward answers /ready" \
    curl -fsS -o /dev/null "http://127.0.0.1:$PORT/ready"
request='{"model": "'$MODEL'", "max_tokens": 32,
  "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}'
for i in 1 2 3; do
    say "request $i: POST /v1/chat/completions"
    reply=$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" \
        -H 'Content-Type: application/json' -d "$request")
    [[ $reply == *'"choices"'* && $reply == *'"assistant"'* ]] \
        || { echo "not a chat completion: $reply" >&2; exit 1; }
    say "reply: ${reply:0:300}"
done
say "metrics (GET /metrics):"
curl -fsS "http://127.0.0.1:$PORT/metrics" | grep -E '^slipstream:(num_requests|kv_cache)' \
    | sed 's/^/      /'

step "7/9 Load from a pod inside the cluster until the autoscaler adds a replica"
# The server image has Python: 16 threads, each sending completions back to back.
LOADGEN='
import json, sys, threading, time, urllib.request
url, workers = sys.argv[1], int(sys.argv[2])
body = json.dumps({"model": sys.argv[3], "prompt": "Tell me a long story about a lighthouse.",
                   "max_tokens": 128, "ignore_eos": True}).encode()
def worker(i):
    done = failed = 0
    while True:
        try:
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=300).read()
            done += 1
        except Exception as exc:
            failed += 1
            print(f"worker {i}: {exc}", flush=True)
            time.sleep(1)
        if (done + failed) % 20 == 0:
            print(f"worker {i}: {done} done, {failed} failed", flush=True)
for i in range(workers):
    threading.Thread(target=worker, args=(i,)).start()
'
run "${KUBECTL[@]}" -n "$NAMESPACE" run e2e-load --image "$SERVER_IMAGE" --restart Never \
    --command -- python -c "$LOADGEN" "http://$ISVC.$NAMESPACE.svc/v1/completions" 16 "$MODEL"
wait_until "$SCALE_TIMEOUT" "the autoscaler asks for 2 replicas" replicas_at_least 2
run "${KUBECTL[@]}" -n "$NAMESPACE" get pods -l "slipstream.dev/inferenceservice=$ISVC"
run "${KUBECTL[@]}" -n "$NAMESPACE" get events --field-selector "involvedObject.name=$ISVC,reason=Scaled"

step "8/9 Stopping the load; the autoscaler scales back down"
run "${KUBECTL[@]}" -n "$NAMESPACE" logs e2e-load --tail 5 || true
run "${KUBECTL[@]}" -n "$NAMESPACE" delete pod e2e-load --now
wait_until "$SCALE_TIMEOUT" "the autoscaler is back at 1 replica" replicas_at_most 1
run "${KUBECTL[@]}" -n "$NAMESPACE" get events --field-selector "involvedObject.name=$ISVC,reason=Scaled"
kill "$PORT_FORWARD_PID" 2>/dev/null || true
PORT_FORWARD_PID=""

step "9/9 Deleting the example, helm uninstall, deleting the CRDs; nothing may be left"
# The operator removes its finalizer, so the InferenceService goes before the operator does.
run "${KUBECTL[@]}" -n "$NAMESPACE" delete infsvc "$ISVC" --wait --timeout 2m
run "${KUBECTL[@]}" -n "$NAMESPACE" wait --for=delete "deploy/$ISVC" "svc/$ISVC" --timeout 2m \
    2>/dev/null || true
run "${HELM[@]}" uninstall "$RELEASE" --namespace "$OPERATOR_NAMESPACE" --wait --timeout 2m
say "Helm keeps CRDs on uninstall; deleting them (and kopf's peering object with them)"
run "${KUBECTL[@]}" delete -f "$ROOT/charts/slipstream/crds/" --wait --timeout 2m
left=$(
    "${KUBECTL[@]}" get all,serviceaccounts,roles,rolebindings -A --no-headers \
        -l "app.kubernetes.io/instance=$RELEASE" 2>/dev/null || echo "(listing failed)"
    "${KUBECTL[@]}" get clusterroles,clusterrolebindings --no-headers \
        -l "app.kubernetes.io/instance=$RELEASE" 2>/dev/null || echo "(listing failed)"
    "${KUBECTL[@]}" get all -A --no-headers -l app.kubernetes.io/managed-by=slipstream-operator \
        2>/dev/null || echo "(listing failed)"
    "${KUBECTL[@]}" get crd --no-headers 2>/dev/null | grep -E 'slipstream\.dev|kopf\.dev' || true
)
if [[ -n $left ]]; then
    echo "left behind after uninstall:" >&2
    echo "$left" >&2
    exit 1
fi
say "nothing left: no release objects, no model servers, no CRDs"

step "PASS: install, serve, scale up, scale down, uninstall"
