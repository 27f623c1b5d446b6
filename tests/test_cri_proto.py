"""Our api.proto speaks the official CRI v1 wire format: package runtime.v1, the
official service and method names, and the official field numbers (as published in
k8s.io/cri-api pkg/apis/runtime/v1/api.proto). The committed stubs match the proto."""

from __future__ import annotations

from pathlib import Path

from nodeagent.runtime.cri import regen
from nodeagent.runtime.cri.gen import api_pb2 as pb

# message -> {field: number} from the official cri-api (v0.35.x), for every field we use
OFFICIAL: dict[str, dict[str, int]] = {
    "VersionRequest": {"version": 1},
    "VersionResponse": {"version": 1, "runtime_name": 2, "runtime_version": 3,
                        "runtime_api_version": 4},
    "StatusRequest": {"verbose": 1},
    "StatusResponse": {"status": 1, "info": 2},
    "RuntimeStatus": {"conditions": 1},
    "RuntimeCondition": {"type": 1, "status": 2, "reason": 3, "message": 4},
    "DNSConfig": {"servers": 1, "searches": 2, "options": 3},
    "PortMapping": {"protocol": 1, "container_port": 2, "host_port": 3, "host_ip": 4},
    "Mount": {"container_path": 1, "host_path": 2, "readonly": 3, "propagation": 5},
    "NamespaceOption": {"network": 1, "pid": 2, "ipc": 3, "target_id": 4},
    "Int64Value": {"value": 1},
    "KeyValue": {"key": 1, "value": 2},
    "ImageSpec": {"image": 1, "annotations": 2},
    "AuthConfig": {"username": 1, "password": 2, "auth": 3, "server_address": 4,
                   "identity_token": 5, "registry_token": 6},
    "PullImageRequest": {"image": 1, "auth": 2, "sandbox_config": 3},
    "PullImageResponse": {"image_ref": 1},
    "SELinuxOption": {"user": 1, "role": 2, "type": 3, "level": 4},
    "SecurityProfile": {"profile_type": 1, "localhost_ref": 2},
    "Capability": {"add_capabilities": 1, "drop_capabilities": 2},
    "LinuxSandboxSecurityContext": {"namespace_options": 1, "selinux_options": 2,
                                    "run_as_user": 3, "readonly_rootfs": 4,
                                    "supplemental_groups": 5, "privileged": 6,
                                    "run_as_group": 8, "seccomp": 9, "apparmor": 10},
    "LinuxContainerResources": {"cpu_period": 1, "cpu_quota": 2, "cpu_shares": 3,
                                "memory_limit_in_bytes": 4, "oom_score_adj": 5},
    "LinuxPodSandboxConfig": {"cgroup_parent": 1, "security_context": 2, "sysctls": 3,
                              "overhead": 4},
    "PodSandboxMetadata": {"name": 1, "uid": 2, "namespace": 3, "attempt": 4},
    "PodSandboxConfig": {"metadata": 1, "hostname": 2, "log_directory": 3, "dns_config": 4,
                         "port_mappings": 5, "labels": 6, "annotations": 7, "linux": 8},
    "RunPodSandboxRequest": {"config": 1, "runtime_handler": 2},
    "RunPodSandboxResponse": {"pod_sandbox_id": 1},
    "StopPodSandboxRequest": {"pod_sandbox_id": 1},
    "RemovePodSandboxRequest": {"pod_sandbox_id": 1},
    "PodSandboxStatusRequest": {"pod_sandbox_id": 1, "verbose": 2},
    "PodIP": {"ip": 1},
    "PodSandboxNetworkStatus": {"ip": 1, "additional_ips": 2},
    "Namespace": {"options": 2},
    "LinuxPodSandboxStatus": {"namespaces": 1},
    "PodSandboxStatus": {"id": 1, "metadata": 2, "state": 3, "created_at": 4, "network": 5,
                         "linux": 6, "labels": 7, "annotations": 8, "runtime_handler": 9},
    "PodSandboxStatusResponse": {"status": 1, "info": 2},
    "PodSandboxStateValue": {"state": 1},
    "PodSandboxFilter": {"id": 1, "state": 2, "label_selector": 3},
    "ListPodSandboxRequest": {"filter": 1},
    "PodSandbox": {"id": 1, "metadata": 2, "state": 3, "created_at": 4, "labels": 5,
                   "annotations": 6, "runtime_handler": 7},
    "ListPodSandboxResponse": {"items": 1},
    "LinuxContainerSecurityContext": {"capabilities": 1, "privileged": 2,
                                      "namespace_options": 3, "selinux_options": 4,
                                      "run_as_user": 5, "readonly_rootfs": 7,
                                      "supplemental_groups": 8, "no_new_privs": 11,
                                      "run_as_group": 12, "seccomp": 15, "apparmor": 16},
    "LinuxContainerConfig": {"resources": 1, "security_context": 2},
    "ContainerMetadata": {"name": 1, "attempt": 2},
    "ContainerConfig": {"metadata": 1, "image": 2, "command": 3, "args": 4, "working_dir": 5,
                        "envs": 6, "mounts": 7, "labels": 9, "annotations": 10,
                        "log_path": 11, "stdin": 12, "stdin_once": 13, "tty": 14,
                        "linux": 15},
    "CreateContainerRequest": {"pod_sandbox_id": 1, "config": 2, "sandbox_config": 3},
    "CreateContainerResponse": {"container_id": 1},
    "StartContainerRequest": {"container_id": 1},
    "StopContainerRequest": {"container_id": 1, "timeout": 2},
    "RemoveContainerRequest": {"container_id": 1},
    "ContainerStateValue": {"state": 1},
    "ContainerFilter": {"id": 1, "state": 2, "pod_sandbox_id": 3, "label_selector": 4},
    "ListContainersRequest": {"filter": 1},
    "Container": {"id": 1, "pod_sandbox_id": 2, "metadata": 3, "image": 4, "image_ref": 5,
                  "state": 6, "created_at": 7, "labels": 8, "annotations": 9,
                  "image_id": 10},
    "ListContainersResponse": {"containers": 1},
    "ContainerStatusRequest": {"container_id": 1, "verbose": 2},
    "ContainerStatus": {"id": 1, "metadata": 2, "state": 3, "created_at": 4,
                        "started_at": 5, "finished_at": 6, "exit_code": 7, "image": 8,
                        "image_ref": 9, "reason": 10, "message": 11, "labels": 12,
                        "annotations": 13, "mounts": 14, "log_path": 15, "resources": 16,
                        "image_id": 17},
    "ContainerResources": {"linux": 1},
    "UpdateContainerResourcesRequest": {"container_id": 1, "linux": 2},
    "UpdateContainerResourcesResponse": {},
    "ContainerStatusResponse": {"status": 1, "info": 2},
    "Image": {"id": 1, "repo_tags": 2, "repo_digests": 3, "size": 4, "uid": 5,
              "username": 6, "spec": 7, "pinned": 8},
    "ImageFilter": {"image": 1},
    "ListImagesRequest": {"filter": 1},
    "ListImagesResponse": {"images": 1},
    "ImageStatusRequest": {"image": 1, "verbose": 2},
    "ImageStatusResponse": {"image": 1, "info": 2},
    "RemoveImageRequest": {"image": 1},
    "RemoveImageResponse": {},
    "ImageFsInfoRequest": {},
    "ImageFsInfoResponse": {"image_filesystems": 1, "container_filesystems": 2},
    "ReopenContainerLogRequest": {"container_id": 1},
    "ExecSyncRequest": {"container_id": 1, "cmd": 2, "timeout": 3},
    "ExecSyncResponse": {"stdout": 1, "stderr": 2, "exit_code": 3},
    "ExecRequest": {"container_id": 1, "cmd": 2, "tty": 3, "stdin": 4, "stdout": 5,
                    "stderr": 6},
    "ExecResponse": {"url": 1},
    "AttachRequest": {"container_id": 1, "stdin": 2, "tty": 3, "stdout": 4, "stderr": 5},
    "AttachResponse": {"url": 1},
    "PortForwardRequest": {"pod_sandbox_id": 1, "port": 2},
    "PortForwardResponse": {"url": 1},
    "UInt64Value": {"value": 1},
    "ContainerStatsFilter": {"id": 1, "pod_sandbox_id": 2, "label_selector": 3},
    "ListContainerStatsRequest": {"filter": 1},
    "ContainerAttributes": {"id": 1, "metadata": 2, "labels": 3, "annotations": 4},
    "CpuUsage": {"timestamp": 1, "usage_core_nano_seconds": 2, "usage_nano_cores": 3},
    "MemoryUsage": {"timestamp": 1, "working_set_bytes": 2, "available_bytes": 3,
                    "usage_bytes": 4, "rss_bytes": 5, "page_faults": 6,
                    "major_page_faults": 7},
    "FilesystemIdentifier": {"mountpoint": 1},
    "FilesystemUsage": {"timestamp": 1, "fs_id": 2, "used_bytes": 3, "inodes_used": 4},
    "ContainerStats": {"attributes": 1, "cpu": 2, "memory": 3, "writable_layer": 4},
    "ListContainerStatsResponse": {"stats": 1},
    "GetEventsRequest": {},
    "ContainerEventResponse": {"container_id": 1, "container_event_type": 2, "created_at": 3,
                               "pod_sandbox_status": 4, "containers_statuses": 5},
}

OFFICIAL_ENUMS: dict[str, dict[str, int]] = {
    "Protocol": {"TCP": 0, "UDP": 1, "SCTP": 2},
    "NamespaceMode": {"POD": 0, "CONTAINER": 1, "NODE": 2, "TARGET": 3},
    "PodSandboxState": {"SANDBOX_READY": 0, "SANDBOX_NOTREADY": 1},
    "ContainerState": {"CONTAINER_CREATED": 0, "CONTAINER_RUNNING": 1,
                       "CONTAINER_EXITED": 2, "CONTAINER_UNKNOWN": 3},
    "ContainerEventType": {"CONTAINER_CREATED_EVENT": 0, "CONTAINER_STARTED_EVENT": 1,
                           "CONTAINER_STOPPED_EVENT": 2, "CONTAINER_DELETED_EVENT": 3},
}


def test_package_and_field_numbers_match_the_official_cri_api() -> None:
    fd = pb.DESCRIPTOR
    assert fd.package == "runtime.v1"
    for message, fields in OFFICIAL.items():
        desc = fd.message_types_by_name[message]
        ours = {f.name: f.number for f in desc.fields}
        assert ours == fields, f"runtime.v1.{message}"
    for enum, values in OFFICIAL_ENUMS.items():
        assert {v.name: v.number for v in fd.enum_types_by_name[enum].values} == values


def test_services_and_methods_are_the_official_names() -> None:
    rt = pb.DESCRIPTOR.services_by_name["RuntimeService"]
    img = pb.DESCRIPTOR.services_by_name["ImageService"]
    assert rt.full_name == "runtime.v1.RuntimeService"
    assert img.full_name == "runtime.v1.ImageService"
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in rt.methods}
    assert methods["ListPodSandbox"] == ("ListPodSandboxRequest", "ListPodSandboxResponse")
    assert methods["StopContainer"] == ("StopContainerRequest", "StopContainerResponse")
    assert set(methods) == {"Version", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox",
                            "PodSandboxStatus", "ListPodSandbox", "CreateContainer",
                            "StartContainer", "StopContainer", "RemoveContainer",
                            "ListContainers", "ContainerStatus", "UpdateContainerResources",
                            "Status",
                            "ReopenContainerLog", "ExecSync", "Exec", "Attach", "PortForward",
                            "ListContainerStats", "GetContainerEvents"}
    events = rt.methods_by_name["GetContainerEvents"]
    assert (events.input_type.name, events.output_type.name) == ("GetEventsRequest",
                                                                 "ContainerEventResponse")
    assert events.server_streaming
    assert {m.name for m in img.methods} == {"ListImages", "ImageStatus", "PullImage",
                                             "RemoveImage", "ImageFsInfo"}


def test_map_fields_have_string_keys_and_values() -> None:
    labels = pb.PodSandboxConfig.DESCRIPTOR.fields_by_name["labels"]
    entry = labels.message_type
    assert entry is not None and entry.GetOptions().map_entry
    assert [f.type for f in entry.fields] == [entry.fields[0].TYPE_STRING] * 2


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generated = regen.regenerate(tmp_path)
    for path in generated:
        committed = regen.GEN / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run python -m nodeagent.runtime.cri.regen")
