"""NodeStatus computation, meaningful-change detection, report decisions, patches."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from nodeagent.node.host import HostReadError, HostReadings
from nodeagent.node.status import (
    build_patch,
    compute_status,
    meaningful_changes,
    report_reason,
)
from tests.conftest import GI, READINGS, SETTINGS
from tests.fakekube import strategic_merge as merge_patch

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
IMAGES = [{"names": ["localhost/a:1"], "sizeBytes": 10},
          {"names": ["localhost/b:1"], "sizeBytes": 30},
          {"names": ["localhost/c:1"], "sizeBytes": 20}]


def status(readings: HostReadings | HostReadError = READINGS, images=IMAGES, at: float = 0,
           previous=None, settings=SETTINGS, not_ready=None, pressure=None):
    return compute_status(readings, settings, images, T0 + dt.timedelta(seconds=at),
                          previous=previous, not_ready=not_ready, pressure=pressure)


def test_allocatable_is_capacity_less_the_reservations_and_the_eviction_thresholds():
    # --system-reserved cpu=500m,memory=1Gi with --kube-reserved
    # cpu=250m,memory=512Mi,ephemeral-storage=1Gi
    settings = dataclasses.replace(
        SETTINGS, system_reserved={"cpu": 0.75, "memory": GI + 512 * 2**20,
                                   "ephemeral-storage": GI},
        # memory.available<5%, nodefs.available<2Gi
        eviction_held={"memory": (0.0, 5.0), "ephemeral-storage": (2.0 * GI, 0.0)})
    st = compute_status(READINGS, settings, [], T0)
    # memory: 8Gi - 1Gi - 512Mi - 5% of 8Gi; disk: 100Gi - 1Gi - 2Gi; cpu: 4 - 0.5 - 0.25
    assert st["allocatable"] == {"cpu": "3250m", "memory": str(8 * GI - GI - 512 * 2**20
                                                                - 8 * GI // 20),
                                 "ephemeral-storage": "97Gi", "pods": "110"}


def cond(st, ctype):
    return next(c for c in st["conditions"] if c["type"] == ctype)


def test_compute_capacity_allocatable_info_and_conditions():
    st = status()
    assert st["capacity"] == {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "100Gi",
                              "pods": "110"}
    # the kubelet's: capacity less --system-reserved (0.5 cpu, 1Gi) and the hard eviction
    # thresholds of memory (100Mi) and the node's filesystem (10%)
    assert st["allocatable"] == {"cpu": "3500m", "memory": "7068Mi",
                                 "ephemeral-storage": "90Gi", "pods": "110"}
    assert st["nodeInfo"]["kernelVersion"] == "6.1.0"
    assert st["nodeInfo"]["kubeletVersion"] == "v0.1.0"
    assert st["addresses"] == [{"type": "InternalIP", "address": "10.0.0.5"},
                               {"type": "Hostname", "address": "h1"}]
    assert [c["type"] for c in st["conditions"]] == ["MemoryPressure", "DiskPressure",
                                                     "PIDPressure", "Ready"]
    assert [c["status"] for c in st["conditions"]] == ["False", "False", "False", "True"]
    assert cond(st, "Ready")["lastHeartbeatTime"] == "2026-01-01T00:00:00Z"


def test_images_largest_first_and_capped():
    st = status(settings=dataclasses.replace(SETTINGS, max_images=2))
    assert [i["names"][0] for i in st["images"]] == ["localhost/b:1", "localhost/c:1"]
    assert status(images=[])["images"] == []


@pytest.mark.parametrize("ctype, reason", [
    ("MemoryPressure", "KubeletHasInsufficientMemory"),
    ("DiskPressure", "KubeletHasDiskPressure"),
    ("PIDPressure", "KubeletHasInsufficientPID"),
])
def test_pressure_conditions_are_the_eviction_managers(ctype, reason):
    why = "below eviction threshold: x<1"
    st = status(pressure={ctype: why})
    c = cond(st, ctype)
    assert (c["status"], c["reason"], c["message"]) == ("True", reason, why)
    others = [x["status"] for x in st["conditions"] if x["type"] not in (ctype, "Ready")]
    assert others == ["False", "False"]
    # the host's readings alone decide none of them
    low = status(dataclasses.replace(READINGS, memoryAvailable=1, fsAvailable=1))
    assert {c["reason"] for c in low["conditions"] if c["type"] != "Ready"} == {
        "KubeletHasSufficientMemory", "KubeletHasNoDiskPressure", "KubeletHasSufficientPID"}


def test_host_read_failure_makes_not_ready_and_keeps_last_values():
    good = status()
    bad = status(HostReadError("cannot read /proc/meminfo: No such file"), at=10, previous=good)
    assert cond(bad, "Ready")["status"] == "False"
    assert "meminfo" in cond(bad, "Ready")["message"]
    assert cond(bad, "MemoryPressure")["status"] == "Unknown"
    assert bad["capacity"] == good["capacity"]


def test_transition_time_kept_until_status_changes():
    a = status(at=0)
    b = status(at=10, previous=a)
    assert cond(b, "Ready")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert cond(b, "Ready")["lastHeartbeatTime"] == "2026-01-01T00:00:10Z"
    c = status(at=20, previous=b, not_ready="runtime down")
    assert cond(c, "Ready")["status"] == "False"
    assert cond(c, "Ready")["lastTransitionTime"] == "2026-01-01T00:00:20Z"


BASE = status()


def _variant(**kw):
    r = dataclasses.replace(READINGS, **{k: v for k, v in kw.items() if k != "images"})
    return status(r, images=kw.get("images", IMAGES), at=37, previous=BASE)


# Meaningful-change table: (description, new status, expected change names)
CASES = [
    ("heartbeat time only", status(at=37, previous=BASE), []),
    ("memory use moves, no threshold crossed", _variant(memoryAvailable=3 * GI), []),
    ("disk fills a little", _variant(fsAvailable=40 * GI), []),
    ("pids come and go", _variant(pidsRunning=900), []),
    ("memory pressure", status(at=37, previous=BASE, pressure={"MemoryPressure": "m"}),
     ["conditions/MemoryPressure"]),
    ("disk pressure", status(at=37, previous=BASE, pressure={"DiskPressure": "d"}),
     ["conditions/DiskPressure"]),
    ("pid pressure", status(at=37, previous=BASE, pressure={"PIDPressure": "p"}),
     ["conditions/PIDPressure"]),
    ("not ready", status(at=37, previous=BASE, not_ready="x"), ["conditions/Ready"]),
    ("cpu count", _variant(cpu=8), ["allocatable", "capacity"]),
    ("kernel upgrade", _variant(kernelVersion="6.2.0"), ["nodeInfo"]),
    ("new address", _variant(addresses=(("InternalIP", "10.0.0.6"), ("Hostname", "h1"))),
     ["addresses"]),
    ("image pulled", _variant(images=[*IMAGES, {"names": ["localhost/d:1"], "sizeBytes": 5}]),
     ["images"]),
    ("image list order only from the runtime", _variant(images=list(reversed(IMAGES))), []),
]


@pytest.mark.parametrize("desc, new, expected", CASES, ids=[c[0] for c in CASES])
def test_meaningful_changes(desc, new, expected):
    assert meaningful_changes(BASE, new) == expected


def test_nothing_reported_yet_is_a_change():
    assert meaningful_changes(None, BASE) == ["all"]


@pytest.mark.parametrize("now, last, changed, expected", [
    (0, None, False, "register"),
    (10, 0, False, None),
    (10, 0, True, "change"),
    (290, 0, False, None),
    (296, 0, False, "period"),  # the tick nearest the period counts
    (300, 0, False, "period"),
    (300, 0, True, "period"),  # a full report covers the change
    (19.9, 0.0, False, None),
])
def test_report_reason(now, last, changed, expected):
    assert report_reason(now, last, changed, report_every=300, update_every=10) == expected


def test_report_period_20s_on_10s_ticks_with_jitter():
    last = 0.0
    reports = []
    for tick in range(1, 13):
        now = tick * 10 + (0.01 if tick % 2 else -0.01)
        if report_reason(now, last, False, report_every=20, update_every=10):
            reports.append(tick)
            last = now
    assert reports == [2, 4, 6, 8, 10, 12]


def test_change_patch_carries_only_what_changed():
    new = status(at=37, previous=BASE, pressure={"MemoryPressure": "m"})
    body = build_patch(BASE, new, meaningful_changes(BASE, new), full=False)
    assert list(body["status"]) == ["conditions"]
    assert [c["type"] for c in body["status"]["conditions"]] == ["MemoryPressure"]


def test_period_patch_refreshes_every_heartbeat_and_applies():
    new = status(at=300, previous=BASE)
    body = build_patch(BASE, new, [], full=True)
    assert list(body["status"]) == ["conditions"]
    merged = merge_patch(BASE, body["status"])
    assert {c["lastHeartbeatTime"] for c in merged["conditions"]} == {"2026-01-01T00:05:00Z"}
    assert merged["capacity"] == BASE["capacity"]


def test_patches_replace_addresses_and_drop_removed_resources():
    new = _variant(addresses=(("Hostname", "h1"),), kernelVersion="6.2.0")
    new["capacity"].pop("ephemeral-storage")
    changes = meaningful_changes(BASE, new)
    body = build_patch(BASE, new, changes, full=False)["status"]
    assert body["nodeInfo"] == {"kernelVersion": "6.2.0"}
    assert body["capacity"]["ephemeral-storage"] is None
    merged = merge_patch(BASE, body)
    assert merged["addresses"] == [{"type": "Hostname", "address": "h1"}]
    assert "ephemeral-storage" not in merged["capacity"]
    assert merged["nodeInfo"]["kernelVersion"] == "6.2.0"


def test_statuses_from_one_reading_share_their_parts():
    """Virtual nodes share one reading and one image list: their statuses hold the same
    capacity, allocatable, addresses, nodeInfo and images objects (one copy for all),
    and so does a later status whose parts are equal; a part that changed is new."""
    a, b = status(), status(at=10)
    later = status(dataclasses.replace(READINGS, memoryAvailable=3 * GI), at=20,
                   images=list(IMAGES))
    for key in ("capacity", "allocatable", "addresses", "nodeInfo", "images"):
        assert a[key] is b[key] is later[key], key
    assert a["conditions"] is not b["conditions"]  # heartbeat times are each status's own
    kernel = status(dataclasses.replace(READINGS, kernelVersion="6.2.0"), at=30)
    assert kernel["nodeInfo"] is not a["nodeInfo"]
    assert kernel["nodeInfo"]["kernelVersion"] == "6.2.0"
    assert a["nodeInfo"]["kernelVersion"] != "6.2.0"  # the shared one was not changed
    assert kernel["capacity"] is a["capacity"]
    assert meaningful_changes(a, later) == [] and meaningful_changes(a, kernel) == ["nodeInfo"]
