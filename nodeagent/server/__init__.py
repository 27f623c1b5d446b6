"""The kubelet API the agent serves (logs, exec, attach, port-forward, stats), with
the kubelet's webhook authentication and authorization; see app.py."""
