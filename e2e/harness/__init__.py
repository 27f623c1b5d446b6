"""What the e2e tests share, in modules of their own; test modules import from here (or
from e2e/conftest.py), never from each other (tests/test_layout.py checks it).

- ports: free loopback ports, and which sockets a process listens on
- waits: polling until a condition holds (a Node registered, say)
- processes: the processes a test started: alive, their environment, stopping them
- namespaces: a namespace pods can be created in
- apirequests: plain blocking API requests over the kubernetes client
- promtext: reading Prometheus text exposition
- tcpproxy: a loopback TCP proxy a test can cut
- slowdisk: a folder on a FUSE filesystem that can be made slow
- agents: nodepulse-agent processes (one node each, or virtual nodes)
- heartbeats: watching Lease and Node writes; the efficient-heartbeat scenario
- operators: nodepulse-operator processes, their credentials and leader, the
  NodeStatusPolicy CRD, a Lease renewer standing in for agents
- pools: agents in node pools under policies; the operator's pool and failover
  scenarios
- taints: agents with a config file, a watch on one Node; the disk-pressure taint
  scenario
- helm: helm and kubectl on the cluster; values that keep the chart's pods Pending
- release: the chart installed, and kubeconfigs for its ServiceAccounts
- nodeenv: one node for one test with its own runtime (containerd or the process
  runtime), agent process and namespace; what the runtime holds
- logind: a private D-Bus with a stand-in systemd-logind on it (graceful node shutdown)

The control plane itself is nodepulse_dev; kind clusters are e2e/kind; the upstream
conformance run is e2e/conformance.
"""
