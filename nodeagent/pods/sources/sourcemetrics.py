"""Prometheus metrics of the pod sources (one set per process, labelled by source)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from nodeagent.api.reflector import WatchMetrics

MANIFEST_ERRORS = Counter(
    "nodepulse_source_manifest_errors_total",
    "Manifests (files, URL bodies) refused, by source and reason.", ["source", "reason"])
UPDATES = Counter(
    "nodepulse_source_updates_total",
    "Pods delivered by the merge to the sync loop, by operation and source.", ["op", "source"])
NAME_CONFLICTS = Counter(
    "nodepulse_source_name_conflicts_total",
    "Pods hidden because a source of higher precedence has a pod of the same name.",
    ["winner", "loser"])
PODS = Gauge("nodepulse_source_pods", "Pods each source currently delivers.", ["source"])

API_LISTS = Counter(
    "nodepulse_source_api_lists_total",
    "Full reads of the pods bound to the node: the initial list, and relists after "
    "410 Gone (how: list = paginated LIST, watchlist = watch with sendInitialEvents).",
    ["reason", "how"])
API_RELISTS = Counter(
    "nodepulse_source_api_relists_total",
    "Relists after 410 Gone (the watch's resourceVersion was too old).")
API_RESUMES = Counter(
    "nodepulse_source_api_watch_resumes_total",
    "Watches restarted from the last resourceVersion seen, without a relist.", ["reason"])
API_EVENTS = Counter(
    "nodepulse_source_api_watch_events_total", "Watch events received, by type.", ["type"])
API_WATCH = WatchMetrics(API_LISTS, API_RELISTS, API_RESUMES, API_EVENTS)

FILE_SCANS = Counter(
    "nodepulse_source_file_scans_total",
    "Passes over the manifest folder (trigger: inotify, rescan, initial).", ["trigger"])
FILE_INOTIFY = Counter(
    "nodepulse_source_file_inotify_events_total", "inotify events read from the folder.")
HTTP_POLLS = Counter(
    "nodepulse_source_http_polls_total",
    "Manifest URL polls by result (not_modified, unchanged, changed, error).", ["result"])

MIRROR_WRITES = Counter(
    "nodepulse_mirror_pod_writes_total",
    "Mirror pod API writes by verb (create, delete) and result (ok, error).",
    ["verb", "result"])
