"""The pod half of the agent: every pod bound to this process's nodes, from the source
that reports it to the status PATCH that says how it runs.

The path of one pod:

    sources/api.py, file.py, http.py    a source reports the pod (watch, folder, URL)
      -> sources/merge.py               only a real change goes on: ADD, UPDATE, DELETE,
                                        REMOVE or RECONCILE (podupdate.py: the vocabulary)
      -> loops.py  NodeLoops            routed to the loop of the pod's node; PLEG events
                                        (pleg.py) and resyncs come in here too
      -> workers.py  PodWorkers         one serialized worker per pod, latest update wins
      -> syncer.py  PodSyncer           one sync:
           decide.py  compute_pod_actions   what must be done, a pure function of the spec,
                                            the runtime's state and the previous status
           syncer.py  (the executor)        carries the actions out, in order: the pod's
                                            cgroup (cgroups.py, qos.py), sandbox,
                                            init containers, containers, hooks (hooks.py),
                                            images (images.py), volumes (volumes/), env
                                            (env.py, objects.py), names (dns.py)
      -> podstatus.py  StatusManager    the status computed from the spec and the runtime,
                                        PATCHed only when it changed

Around that path: admission.py (may this node run the pod: the pod alone at every
sync, and once beside the node's other pods; resources.py: what a pod asks of its
node), podspec.py (the table of the spec fields the agent honours; anything else
refuses the pod by name), probes.py and handlers.py (liveness, readiness, startup;
exec, HTTP, TCP), backoff.py (CrashLoopBackOff), podhalf.py (the runtime's version and
images for the node status, and what the kubelet API reads).

Nothing here imports nodeagent.node (the heartbeat half) or a concrete runtime; the
composition root (nodeagent.agent) builds every part and hands each its collaborators.
"""
