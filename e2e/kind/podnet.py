"""The kind cluster's pod network, a DaemonSet of our own in kindnet's place.

kind installs /kind/manifests/default-cni.yaml from the node image when the config does
not turn the default CNI off (kind's images hold kindnet there, an image from a
registry; kindnet's sources are no longer in kind's module, and the Go module proxy
serves no kindnet module). Ours is a small one with the same job on one L2 network (the
nodes share kind's Docker network):

- its pod, on every node (host network, NET_ADMIN), reads the Nodes every few seconds;
- for its own node it writes a CNI conflist: Debian's bridge plugin on `cni0` with
  host-local addresses from the node's pod CIDR, no masquerade (pods reach the other
  nodes' pods and hosts by their own address: every node routes every pod CIDR), and
  the portmap plugin for hostPort;
- for every other node it sets a route to that node's pod CIDR through its address.

The node stays NotReady (the runtime's network is not ready) until the conflist is
there; the pods tolerate every taint. It reaches the API server at kind's internal
endpoint (kind adds CONTROL_PLANE_ENDPOINT to the manifest, as for kindnet), so it
does not wait for kube-proxy. Its image holds the node's own iproute2 and dash, and
kubectl (e2e/kind/node.py preloads it into every node).
"""

from __future__ import annotations

import json

IMAGE = "localhost/nodepulse/pod-routes:1"
CONFLIST = "/etc/cni/net.d/10-pod-routes.conflist"
# the packages of the node's root filesystem the image is made of (and kubectl)
PACKAGES = ["iproute2", "dash", "coreutils", "diffutils", "sed"]


def conflist(pod_cidr: str) -> str:
    return json.dumps({"cniVersion": "0.4.0", "name": "pod-routes", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
         "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=2)


# The conflist with the node's CIDR put in by the script (the one place it is written)
CONFLIST_TEMPLATE = conflist("@CIDR@")

SCRIPT = f"""\
#!/usr/bin/dash
# pod-routes (e2e/kind/podnet.py): this node's CNI conflist, and routes to the others'
# pod CIDRs through their addresses; says what it set whenever the Nodes change
set -u
tsv='{{range .items[*]}}{{.metadata.name}}{{" "}}{{.spec.podCIDR}}{{" "}}'
tsv="$tsv"'{{.status.addresses[?(@.type=="InternalIP")].address}}{{"\\n"}}{{end}}'
sa=/var/run/secrets/kubernetes.io/serviceaccount
cat > /tmp/conflist <<'END'
{CONFLIST_TEMPLATE}
END
while :; do
    if kubectl --server="https://$CONTROL_PLANE_ENDPOINT" --token="$(cat $sa/token)" \\
            --certificate-authority=$sa/ca.crt get nodes -o jsonpath="$tsv" > /tmp/nodes; then
        while read -r name cidr address; do
            [ -n "$cidr" ] && [ -n "$address" ] || continue
            if [ "$name" = "$NODE_NAME" ]; then
                sed "s|@CIDR@|$cidr|" /tmp/conflist > /tmp/conflist.node
                cmp -s /tmp/conflist.node {CONFLIST} || \\
                    {{ cp /tmp/conflist.node {CONFLIST}.tmp && mv {CONFLIST}.tmp {CONFLIST}; }}
            else
                ip route replace "$cidr" via "$address"
            fi
        done < /tmp/nodes
        if ! cmp -s /tmp/nodes /tmp/nodes.seen; then
            echo "$(date -u +%FT%TZ) nodes (name, pod CIDR, address):"; cat /tmp/nodes
            ip -4 route show; cp /tmp/nodes /tmp/nodes.seen
        fi
    fi
    sleep 5
done
"""

# kind puts CONTROL_PLANE_ENDPOINT into the first container's env when the manifest
# asks: would you kindly patch this file
MANIFEST = f"""\
# The kind cluster's pod network (e2e/kind/podnet.py); kind patches in the API server's
# address: would you kindly patch this file
apiVersion: v1
kind: ServiceAccount
metadata:
  name: pod-routes
  namespace: kube-system
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: pod-routes
rules:
  - apiGroups: [""]
    resources: [nodes]
    verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: pod-routes
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: pod-routes
subjects:
  - kind: ServiceAccount
    name: pod-routes
    namespace: kube-system
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: pod-routes
  namespace: kube-system
  labels:
    app: pod-routes
spec:
  selector:
    matchLabels:
      app: pod-routes
  template:
    metadata:
      labels:
        app: pod-routes
    spec:
      serviceAccountName: pod-routes
      hostNetwork: true
      dnsPolicy: Default
      priorityClassName: system-node-critical
      tolerations:
        - operator: Exists
      containers:
        - name: pod-routes
          image: {IMAGE}
          imagePullPolicy: IfNotPresent
          command: [/usr/local/bin/pod-routes]
          env:
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
          securityContext:
            capabilities:
              add: [NET_ADMIN]
          resources:
            requests:
              cpu: 10m
              memory: 20Mi
          volumeMounts:
            - name: cni-conf
              mountPath: /etc/cni/net.d
      volumes:
        - name: cni-conf
          hostPath:
            path: /etc/cni/net.d
            type: DirectoryOrCreate
"""
