#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite on a kind cluster, for machines with Docker and kind.
#
#   1. creates the kind cluster (e2e/kind/kind-config.yaml) unless it exists;
#   2. builds the image (Dockerfile) and `kind load`s it into the nodes;
#   3. applies the CRDs with kubectl and installs the chart with the image, and waits
#      until the operator (and, with NODEPULSE_KIND_AGENTS=1, the virtual-node agents)
#      are Ready: the image runs, under the chart's RBAC, read-only root and non-root;
#   4. uninstalls that release (the suite starts its own operators and agents, which
#      must not compete with it) and runs the same e2e suite as the local control
#      plane, against kind, through NODEPULSE_E2E_KUBECONFIG.
#
# Environment: KIND_CLUSTER (nodepulse-e2e), NODEPULSE_IMAGE (nodepulse:e2e),
# NODEPULSE_KIND_AGENTS (1 or 0; by default 1 when nodepulse-agent has --virtual-nodes),
# KEEP_CLUSTER=1 to keep the cluster afterwards, PYTEST_ARGS (extra pytest arguments).
#
# It cannot run on the CI machines of this repository: they have no Docker engine.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
cluster=${KIND_CLUSTER:-nodepulse-e2e}
image=${NODEPULSE_IMAGE:-nodepulse:e2e}
# the virtual-node agents, once the agent has that mode
if .venv/bin/nodepulse-agent --help 2>/dev/null | grep -- --virtual-nodes >/dev/null; then default_agents=1; else default_agents=0; fi
agents=${NODEPULSE_KIND_AGENTS:-$default_agents}
state=${XDG_CACHE_HOME:-$HOME/.cache}/nodepulse/kind
kubeconfig=$state/$cluster.kubeconfig
release=nodepulse
namespace=nodepulse-system

for tool in docker kind; do
    command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is not installed" >&2; exit 2; }
done
docker info >/dev/null 2>&1 || { echo "e2e-kind: no Docker engine is reachable" >&2; exit 2; }
# kubectl and helm at the versions the repository pins (built once into the cache)
eval "$(.venv/bin/python -c '
from e2e.cluster import build
paths = build.ensure(["kubectl", "helm"], log=lambda _: None)
print("kubectl=%s helm=%s" % (paths["kubectl"], paths["helm"]))')"
mkdir -p "$state"

if ! kind get clusters | grep -x "$cluster" >/dev/null; then
    kind create cluster --name "$cluster" --config e2e/kind/kind-config.yaml \
        --kubeconfig "$kubeconfig" --wait 180s
else
    kind get kubeconfig --name "$cluster" > "$kubeconfig"
fi
cleanup() {
    if [ "${KEEP_CLUSTER:-0}" != 1 ]; then kind delete cluster --name "$cluster"; fi
}
trap cleanup EXIT

docker build -t "$image" .
kind load docker-image "$image" --name "$cluster"

k() { "$kubectl" --kubeconfig "$kubeconfig" "$@"; }
h() { "$helm" --kubeconfig "$kubeconfig" "$@"; }

k apply --server-side -f charts/nodepulse/crds/
k wait --for=condition=Established --timeout=60s crd/nodestatuspolicies.nodepulse.dev
h upgrade --install "$release" charts/nodepulse --namespace "$namespace" --create-namespace \
    --set image.repository="${image%:*}" --set image.tag="${image##*:}" \
    --set image.pullPolicy=Never --set agent.enabled="$([ "$agents" = 1 ] && echo true || echo false)" \
    --set agent.nodesPerReplica=3 --set defaultPolicy.enabled=true \
    --wait --timeout 5m
k -n "$namespace" get pods -o wide
# the leader writes every node's effective policy, the real kubelets' nodes included
for node in $(k get nodes -o name); do
    for _ in $(seq 60); do
        k get "$node" -o jsonpath='{.metadata.annotations.nodepulse\.dev/heartbeat}' | grep policy >/dev/null && break
        sleep 1
    done
    k get "$node" -o jsonpath='{.metadata.annotations.nodepulse\.dev/heartbeat}' | grep policy >/dev/null \
        || { echo "e2e-kind: no effective policy on $node" >&2; exit 1; }
done
k get nsp
h uninstall "$release" --namespace "$namespace" --wait

NODEPULSE_E2E_KUBECONFIG=$kubeconfig .venv/bin/pytest e2e ${PYTEST_ARGS:-}
