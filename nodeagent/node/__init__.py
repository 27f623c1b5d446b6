"""The node's heartbeat: registration, NodeStatus computed often but written only on a
meaningful change or once per report period, and a Lease renewed often (KEP-589).

Per-node objects (controller.NodeController, lease.LeaseRenewer) are driven by shared
machinery (scheduler.DueScheduler twice, with separate thread pools; watch.NodeWatch on
nodeagent.api's reflector), composed in nodeagent.agent from one NodeControllerConfig.
They reach the API server through nodeagent.api.kube only.
"""
