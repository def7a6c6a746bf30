#!/usr/bin/env bash
# Builds the local control plane from source into build/cluster/bin (`make cluster` calls this):
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (Kubernetes v1.36.3),
# etcd (the version that release requires), helm (v3.22.0), go-containerregistry's crane and
# registry (image volumes and model images), and the LeaderWorkerSet controller (sigs.k8s.io/lws
# v0.7.0) with its CRD and webhook registrations (into build/cluster/lws). Go's module and build
# caches make a second run a re-link; a cold one took 7.5 minutes on a 2-core Zen 4 with the
# modules already fetched (up to ~22 on earlier machines).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../build/cluster/bin}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export CGO_ENABLED=0

kube_version=v1.36.3
# What Kubernetes' own build stamps (hack/lib/version.sh): helm checks a chart's kubeVersion
# against the server's /version, and kubectl warns on version skew, so v0.0.0 will not do.
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=36"
  ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=2026-01-01T00:00:00Z"
done

cd "$here/kube"
echo "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl ($kube_version) ..." >&2
go build -trimpath -ldflags="$ld" -o "$out/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
echo "building etcd ..." >&2
go build -trimpath -ldflags="-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3

cd "$here/helm"
helm_version=$(go list -m -f '{{.Version}}' helm.sh/helm/v3)
# As helm's own Makefile: the Kubernetes version `helm template`/`lint` assume without a cluster
# is that of the client-go it was built with (else v1.20, below the chart's kubeVersion).
k8s_minor=$(go list -m -f '{{.Version}}' k8s.io/client-go | cut -d. -f2)
ld="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  ld+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
echo "building helm ($helm_version) ..." >&2
go build -trimpath -ldflags="$ld" -o "$out/helm" helm.sh/helm/v3/cmd/helm
cd "$here/oci"
echo "building crane and registry ($(go list -m -f '{{.Version}}' github.com/google/go-containerregistry)) ..." >&2
go build -trimpath -ldflags="-s -w" -o "$out/" github.com/google/go-containerregistry/cmd/crane \
  github.com/google/go-containerregistry/cmd/registry
cd "$here/lws"
lws_version=$(go list -m -f '{{.Version}}' sigs.k8s.io/lws)
echo "building the LeaderWorkerSet controller ($lws_version) ..." >&2
go build -trimpath -ldflags="-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$lws_version" \
  -o "$out/lws-controller" sigs.k8s.io/lws/cmd
# The release's own CRD and webhook registrations (config/ of the module), which
# e2e/cluster/lws.py installs; install -m 644: the module cache's files are read-only.
lws_src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/lws)/config
lws_share=$(dirname "$out")/lws
mkdir -p "$lws_share"
install -m 644 "$lws_src/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" \
  "$lws_src/webhook/manifests.yaml" "$lws_src/webhook/mutating-patch.yaml" \
  "$lws_src/webhook/validating-patch.yaml" "$lws_share/"
"$out/kube-apiserver" --version
"$out/helm" version --short
