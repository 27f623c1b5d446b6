"""Pod sources with change detection, and the merge that feeds the sync loop.

- api.py: pods bound to the node from the API server (nodeagent.api's reflector: paginated
  list, watch with bookmarks, resume from the last resourceVersion, relist only on 410)
- file.py: static pod manifests in a folder (inotify + content hash + periodic rescan)
- http.py: static pod manifests from a URL (conditional polls + content hash)
- static.py: manifest checks, the normalized hash and deterministic UID, mirror shape
- mirror.py: mirror pods in the API server, kept in step with the static pods
- merge.py: per-source state diffed into PodUpdates (types.py) on an asyncio.Queue
- events.py: Warning Events on the Node for what the sources refuse

They are wired together by the agent's composition root (nodeagent.agent).
"""
