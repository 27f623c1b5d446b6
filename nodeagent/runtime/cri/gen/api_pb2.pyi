from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Protocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TCP: _ClassVar[Protocol]
    UDP: _ClassVar[Protocol]
    SCTP: _ClassVar[Protocol]

class MountPropagation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPAGATION_PRIVATE: _ClassVar[MountPropagation]
    PROPAGATION_HOST_TO_CONTAINER: _ClassVar[MountPropagation]
    PROPAGATION_BIDIRECTIONAL: _ClassVar[MountPropagation]

class NamespaceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POD: _ClassVar[NamespaceMode]
    CONTAINER: _ClassVar[NamespaceMode]
    NODE: _ClassVar[NamespaceMode]
    TARGET: _ClassVar[NamespaceMode]

class PodSandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_READY: _ClassVar[PodSandboxState]
    SANDBOX_NOTREADY: _ClassVar[PodSandboxState]

class ContainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTAINER_CREATED: _ClassVar[ContainerState]
    CONTAINER_RUNNING: _ClassVar[ContainerState]
    CONTAINER_EXITED: _ClassVar[ContainerState]
    CONTAINER_UNKNOWN: _ClassVar[ContainerState]

class ContainerEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTAINER_CREATED_EVENT: _ClassVar[ContainerEventType]
    CONTAINER_STARTED_EVENT: _ClassVar[ContainerEventType]
    CONTAINER_STOPPED_EVENT: _ClassVar[ContainerEventType]
    CONTAINER_DELETED_EVENT: _ClassVar[ContainerEventType]
TCP: Protocol
UDP: Protocol
SCTP: Protocol
PROPAGATION_PRIVATE: MountPropagation
PROPAGATION_HOST_TO_CONTAINER: MountPropagation
PROPAGATION_BIDIRECTIONAL: MountPropagation
POD: NamespaceMode
CONTAINER: NamespaceMode
NODE: NamespaceMode
TARGET: NamespaceMode
SANDBOX_READY: PodSandboxState
SANDBOX_NOTREADY: PodSandboxState
CONTAINER_CREATED: ContainerState
CONTAINER_RUNNING: ContainerState
CONTAINER_EXITED: ContainerState
CONTAINER_UNKNOWN: ContainerState
CONTAINER_CREATED_EVENT: ContainerEventType
CONTAINER_STARTED_EVENT: ContainerEventType
CONTAINER_STOPPED_EVENT: ContainerEventType
CONTAINER_DELETED_EVENT: ContainerEventType

class VersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class VersionResponse(_message.Message):
    __slots__ = ("version", "runtime_name", "runtime_version", "runtime_api_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_NAME_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_API_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    runtime_name: str
    runtime_version: str
    runtime_api_version: str
    def __init__(self, version: _Optional[str] = ..., runtime_name: _Optional[str] = ..., runtime_version: _Optional[str] = ..., runtime_api_version: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("verbose",)
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    verbose: bool
    def __init__(self, verbose: _Optional[bool] = ...) -> None: ...

class RuntimeCondition(_message.Message):
    __slots__ = ("type", "status", "reason", "message")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    type: str
    status: bool
    reason: str
    message: str
    def __init__(self, type: _Optional[str] = ..., status: _Optional[bool] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RuntimeStatus(_message.Message):
    __slots__ = ("conditions",)
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    conditions: _containers.RepeatedCompositeFieldContainer[RuntimeCondition]
    def __init__(self, conditions: _Optional[_Iterable[_Union[RuntimeCondition, _Mapping]]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("status", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    status: RuntimeStatus
    info: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[_Union[RuntimeStatus, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DNSConfig(_message.Message):
    __slots__ = ("servers", "searches", "options")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedScalarFieldContainer[str]
    searches: _containers.RepeatedScalarFieldContainer[str]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, servers: _Optional[_Iterable[str]] = ..., searches: _Optional[_Iterable[str]] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class PortMapping(_message.Message):
    __slots__ = ("protocol", "container_port", "host_port", "host_ip")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_IP_FIELD_NUMBER: _ClassVar[int]
    protocol: Protocol
    container_port: int
    host_port: int
    host_ip: str
    def __init__(self, protocol: _Optional[_Union[Protocol, str]] = ..., container_port: _Optional[int] = ..., host_port: _Optional[int] = ..., host_ip: _Optional[str] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("container_path", "host_path", "readonly", "propagation")
    CONTAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    PROPAGATION_FIELD_NUMBER: _ClassVar[int]
    container_path: str
    host_path: str
    readonly: bool
    propagation: MountPropagation
    def __init__(self, container_path: _Optional[str] = ..., host_path: _Optional[str] = ..., readonly: _Optional[bool] = ..., propagation: _Optional[_Union[MountPropagation, str]] = ...) -> None: ...

class NamespaceOption(_message.Message):
    __slots__ = ("network", "pid", "ipc", "target_id")
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    network: NamespaceMode
    pid: NamespaceMode
    ipc: NamespaceMode
    target_id: str
    def __init__(self, network: _Optional[_Union[NamespaceMode, str]] = ..., pid: _Optional[_Union[NamespaceMode, str]] = ..., ipc: _Optional[_Union[NamespaceMode, str]] = ..., target_id: _Optional[str] = ...) -> None: ...

class Int64Value(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class ImageSpec(_message.Message):
    __slots__ = ("image", "annotations")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    image: str
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, image: _Optional[str] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SELinuxOption(_message.Message):
    __slots__ = ("user", "role", "type", "level")
    USER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    user: str
    role: str
    type: str
    level: str
    def __init__(self, user: _Optional[str] = ..., role: _Optional[str] = ..., type: _Optional[str] = ..., level: _Optional[str] = ...) -> None: ...

class SecurityProfile(_message.Message):
    __slots__ = ("profile_type", "localhost_ref")
    class ProfileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RuntimeDefault: _ClassVar[SecurityProfile.ProfileType]
        Unconfined: _ClassVar[SecurityProfile.ProfileType]
        Localhost: _ClassVar[SecurityProfile.ProfileType]
    RuntimeDefault: SecurityProfile.ProfileType
    Unconfined: SecurityProfile.ProfileType
    Localhost: SecurityProfile.ProfileType
    PROFILE_TYPE_FIELD_NUMBER: _ClassVar[int]
    LOCALHOST_REF_FIELD_NUMBER: _ClassVar[int]
    profile_type: SecurityProfile.ProfileType
    localhost_ref: str
    def __init__(self, profile_type: _Optional[_Union[SecurityProfile.ProfileType, str]] = ..., localhost_ref: _Optional[str] = ...) -> None: ...

class Capability(_message.Message):
    __slots__ = ("add_capabilities", "drop_capabilities")
    ADD_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    DROP_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    add_capabilities: _containers.RepeatedScalarFieldContainer[str]
    drop_capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, add_capabilities: _Optional[_Iterable[str]] = ..., drop_capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class LinuxSandboxSecurityContext(_message.Message):
    __slots__ = ("namespace_options", "selinux_options", "run_as_user", "readonly_rootfs", "supplemental_groups", "privileged", "run_as_group", "seccomp", "apparmor")
    NAMESPACE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SELINUX_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_USER_FIELD_NUMBER: _ClassVar[int]
    READONLY_ROOTFS_FIELD_NUMBER: _ClassVar[int]
    SUPPLEMENTAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PRIVILEGED_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_GROUP_FIELD_NUMBER: _ClassVar[int]
    SECCOMP_FIELD_NUMBER: _ClassVar[int]
    APPARMOR_FIELD_NUMBER: _ClassVar[int]
    namespace_options: NamespaceOption
    selinux_options: SELinuxOption
    run_as_user: Int64Value
    readonly_rootfs: bool
    supplemental_groups: _containers.RepeatedScalarFieldContainer[int]
    privileged: bool
    run_as_group: Int64Value
    seccomp: SecurityProfile
    apparmor: SecurityProfile
    def __init__(self, namespace_options: _Optional[_Union[NamespaceOption, _Mapping]] = ..., selinux_options: _Optional[_Union[SELinuxOption, _Mapping]] = ..., run_as_user: _Optional[_Union[Int64Value, _Mapping]] = ..., readonly_rootfs: _Optional[bool] = ..., supplemental_groups: _Optional[_Iterable[int]] = ..., privileged: _Optional[bool] = ..., run_as_group: _Optional[_Union[Int64Value, _Mapping]] = ..., seccomp: _Optional[_Union[SecurityProfile, _Mapping]] = ..., apparmor: _Optional[_Union[SecurityProfile, _Mapping]] = ...) -> None: ...

class LinuxContainerResources(_message.Message):
    __slots__ = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj")
    CPU_PERIOD_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    OOM_SCORE_ADJ_FIELD_NUMBER: _ClassVar[int]
    cpu_period: int
    cpu_quota: int
    cpu_shares: int
    memory_limit_in_bytes: int
    oom_score_adj: int
    def __init__(self, cpu_period: _Optional[int] = ..., cpu_quota: _Optional[int] = ..., cpu_shares: _Optional[int] = ..., memory_limit_in_bytes: _Optional[int] = ..., oom_score_adj: _Optional[int] = ...) -> None: ...

class LinuxPodSandboxConfig(_message.Message):
    __slots__ = ("cgroup_parent", "security_context", "sysctls", "overhead")
    class SysctlsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CGROUP_PARENT_FIELD_NUMBER: _ClassVar[int]
    SECURITY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SYSCTLS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    cgroup_parent: str
    security_context: LinuxSandboxSecurityContext
    sysctls: _containers.ScalarMap[str, str]
    overhead: LinuxContainerResources
    def __init__(self, cgroup_parent: _Optional[str] = ..., security_context: _Optional[_Union[LinuxSandboxSecurityContext, _Mapping]] = ..., sysctls: _Optional[_Mapping[str, str]] = ..., overhead: _Optional[_Union[LinuxContainerResources, _Mapping]] = ...) -> None: ...

class PodSandboxMetadata(_message.Message):
    __slots__ = ("name", "uid", "namespace", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    namespace: str
    attempt: int
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PodSandboxConfig(_message.Message):
    __slots__ = ("metadata", "hostname", "log_directory", "dns_config", "port_mappings", "labels", "annotations", "linux")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LOG_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    DNS_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PORT_MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    metadata: PodSandboxMetadata
    hostname: str
    log_directory: str
    dns_config: DNSConfig
    port_mappings: _containers.RepeatedCompositeFieldContainer[PortMapping]
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    linux: LinuxPodSandboxConfig
    def __init__(self, metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., hostname: _Optional[str] = ..., log_directory: _Optional[str] = ..., dns_config: _Optional[_Union[DNSConfig, _Mapping]] = ..., port_mappings: _Optional[_Iterable[_Union[PortMapping, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., linux: _Optional[_Union[LinuxPodSandboxConfig, _Mapping]] = ...) -> None: ...

class RunPodSandboxRequest(_message.Message):
    __slots__ = ("config", "runtime_handler")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    config: PodSandboxConfig
    runtime_handler: str
    def __init__(self, config: _Optional[_Union[PodSandboxConfig, _Mapping]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class RunPodSandboxResponse(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class StopPodSandboxRequest(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class StopPodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemovePodSandboxRequest(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class RemovePodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodSandboxStatusRequest(_message.Message):
    __slots__ = ("pod_sandbox_id", "verbose")
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    verbose: bool
    def __init__(self, pod_sandbox_id: _Optional[str] = ..., verbose: _Optional[bool] = ...) -> None: ...

class PodIP(_message.Message):
    __slots__ = ("ip",)
    IP_FIELD_NUMBER: _ClassVar[int]
    ip: str
    def __init__(self, ip: _Optional[str] = ...) -> None: ...

class PodSandboxNetworkStatus(_message.Message):
    __slots__ = ("ip", "additional_ips")
    IP_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_IPS_FIELD_NUMBER: _ClassVar[int]
    ip: str
    additional_ips: _containers.RepeatedCompositeFieldContainer[PodIP]
    def __init__(self, ip: _Optional[str] = ..., additional_ips: _Optional[_Iterable[_Union[PodIP, _Mapping]]] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: NamespaceOption
    def __init__(self, options: _Optional[_Union[NamespaceOption, _Mapping]] = ...) -> None: ...

class LinuxPodSandboxStatus(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: Namespace
    def __init__(self, namespaces: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class PodSandboxStatus(_message.Message):
    __slots__ = ("id", "metadata", "state", "created_at", "network", "linux", "labels", "annotations", "runtime_handler")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: PodSandboxMetadata
    state: PodSandboxState
    created_at: int
    network: PodSandboxNetworkStatus
    linux: LinuxPodSandboxStatus
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    runtime_handler: str
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., state: _Optional[_Union[PodSandboxState, str]] = ..., created_at: _Optional[int] = ..., network: _Optional[_Union[PodSandboxNetworkStatus, _Mapping]] = ..., linux: _Optional[_Union[LinuxPodSandboxStatus, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class PodSandboxStatusResponse(_message.Message):
    __slots__ = ("status", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    status: PodSandboxStatus
    info: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[_Union[PodSandboxStatus, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PodSandboxStateValue(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: PodSandboxState
    def __init__(self, state: _Optional[_Union[PodSandboxState, str]] = ...) -> None: ...

class PodSandboxFilter(_message.Message):
    __slots__ = ("id", "state", "label_selector")
    class LabelSelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABEL_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: PodSandboxStateValue
    label_selector: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[PodSandboxStateValue, _Mapping]] = ..., label_selector: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListPodSandboxRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: PodSandboxFilter
    def __init__(self, filter: _Optional[_Union[PodSandboxFilter, _Mapping]] = ...) -> None: ...

class PodSandbox(_message.Message):
    __slots__ = ("id", "metadata", "state", "created_at", "labels", "annotations", "runtime_handler")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: PodSandboxMetadata
    state: PodSandboxState
    created_at: int
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    runtime_handler: str
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., state: _Optional[_Union[PodSandboxState, str]] = ..., created_at: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class ListPodSandboxResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PodSandbox]
    def __init__(self, items: _Optional[_Iterable[_Union[PodSandbox, _Mapping]]] = ...) -> None: ...

class LinuxContainerSecurityContext(_message.Message):
    __slots__ = ("capabilities", "privileged", "namespace_options", "selinux_options", "run_as_user", "readonly_rootfs", "supplemental_groups", "no_new_privs", "run_as_group", "seccomp", "apparmor")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PRIVILEGED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SELINUX_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_USER_FIELD_NUMBER: _ClassVar[int]
    READONLY_ROOTFS_FIELD_NUMBER: _ClassVar[int]
    SUPPLEMENTAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NO_NEW_PRIVS_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_GROUP_FIELD_NUMBER: _ClassVar[int]
    SECCOMP_FIELD_NUMBER: _ClassVar[int]
    APPARMOR_FIELD_NUMBER: _ClassVar[int]
    capabilities: Capability
    privileged: bool
    namespace_options: NamespaceOption
    selinux_options: SELinuxOption
    run_as_user: Int64Value
    readonly_rootfs: bool
    supplemental_groups: _containers.RepeatedScalarFieldContainer[int]
    no_new_privs: bool
    run_as_group: Int64Value
    seccomp: SecurityProfile
    apparmor: SecurityProfile
    def __init__(self, capabilities: _Optional[_Union[Capability, _Mapping]] = ..., privileged: _Optional[bool] = ..., namespace_options: _Optional[_Union[NamespaceOption, _Mapping]] = ..., selinux_options: _Optional[_Union[SELinuxOption, _Mapping]] = ..., run_as_user: _Optional[_Union[Int64Value, _Mapping]] = ..., readonly_rootfs: _Optional[bool] = ..., supplemental_groups: _Optional[_Iterable[int]] = ..., no_new_privs: _Optional[bool] = ..., run_as_group: _Optional[_Union[Int64Value, _Mapping]] = ..., seccomp: _Optional[_Union[SecurityProfile, _Mapping]] = ..., apparmor: _Optional[_Union[SecurityProfile, _Mapping]] = ...) -> None: ...

class LinuxContainerConfig(_message.Message):
    __slots__ = ("resources", "security_context")
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    SECURITY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    resources: LinuxContainerResources
    security_context: LinuxContainerSecurityContext
    def __init__(self, resources: _Optional[_Union[LinuxContainerResources, _Mapping]] = ..., security_context: _Optional[_Union[LinuxContainerSecurityContext, _Mapping]] = ...) -> None: ...

class ContainerMetadata(_message.Message):
    __slots__ = ("name", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    attempt: int
    def __init__(self, name: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class ContainerConfig(_message.Message):
    __slots__ = ("metadata", "image", "command", "args", "working_dir", "envs", "mounts", "labels", "annotations", "log_path", "stdin", "stdin_once", "tty", "linux")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDIN_ONCE_FIELD_NUMBER: _ClassVar[int]
    TTY_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    metadata: ContainerMetadata
    image: ImageSpec
    command: _containers.RepeatedScalarFieldContainer[str]
    args: _containers.RepeatedScalarFieldContainer[str]
    working_dir: str
    envs: _containers.RepeatedCompositeFieldContainer[KeyValue]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    log_path: str
    stdin: bool
    stdin_once: bool
    tty: bool
    linux: LinuxContainerConfig
    def __init__(self, metadata: _Optional[_Union[ContainerMetadata, _Mapping]] = ..., image: _Optional[_Union[ImageSpec, _Mapping]] = ..., command: _Optional[_Iterable[str]] = ..., args: _Optional[_Iterable[str]] = ..., working_dir: _Optional[str] = ..., envs: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., log_path: _Optional[str] = ..., stdin: _Optional[bool] = ..., stdin_once: _Optional[bool] = ..., tty: _Optional[bool] = ..., linux: _Optional[_Union[LinuxContainerConfig, _Mapping]] = ...) -> None: ...

class CreateContainerRequest(_message.Message):
    __slots__ = ("pod_sandbox_id", "config", "sandbox_config")
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_CONFIG_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    config: ContainerConfig
    sandbox_config: PodSandboxConfig
    def __init__(self, pod_sandbox_id: _Optional[str] = ..., config: _Optional[_Union[ContainerConfig, _Mapping]] = ..., sandbox_config: _Optional[_Union[PodSandboxConfig, _Mapping]] = ...) -> None: ...

class CreateContainerResponse(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class StartContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class StartContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopContainerRequest(_message.Message):
    __slots__ = ("container_id", "timeout")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    timeout: int
    def __init__(self, container_id: _Optional[str] = ..., timeout: _Optional[int] = ...) -> None: ...

class StopContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class RemoveContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStateValue(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: ContainerState
    def __init__(self, state: _Optional[_Union[ContainerState, str]] = ...) -> None: ...

class ContainerFilter(_message.Message):
    __slots__ = ("id", "state", "pod_sandbox_id", "label_selector")
    class LabelSelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: ContainerStateValue
    pod_sandbox_id: str
    label_selector: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[ContainerStateValue, _Mapping]] = ..., pod_sandbox_id: _Optional[str] = ..., label_selector: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListContainersRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: ContainerFilter
    def __init__(self, filter: _Optional[_Union[ContainerFilter, _Mapping]] = ...) -> None: ...

class Container(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "metadata", "image", "image_ref", "state", "created_at", "labels", "annotations", "image_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    metadata: ContainerMetadata
    image: ImageSpec
    image_ref: str
    state: ContainerState
    created_at: int
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    image_id: str
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., metadata: _Optional[_Union[ContainerMetadata, _Mapping]] = ..., image: _Optional[_Union[ImageSpec, _Mapping]] = ..., image_ref: _Optional[str] = ..., state: _Optional[_Union[ContainerState, str]] = ..., created_at: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., image_id: _Optional[str] = ...) -> None: ...

class ListContainersResponse(_message.Message):
    __slots__ = ("containers",)
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    containers: _containers.RepeatedCompositeFieldContainer[Container]
    def __init__(self, containers: _Optional[_Iterable[_Union[Container, _Mapping]]] = ...) -> None: ...

class ContainerStatusRequest(_message.Message):
    __slots__ = ("container_id", "verbose")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    verbose: bool
    def __init__(self, container_id: _Optional[str] = ..., verbose: _Optional[bool] = ...) -> None: ...

class ContainerStatus(_message.Message):
    __slots__ = ("id", "metadata", "state", "created_at", "started_at", "finished_at", "exit_code", "image", "image_ref", "reason", "message", "labels", "annotations", "mounts", "log_path", "resources", "image_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: ContainerMetadata
    state: ContainerState
    created_at: int
    started_at: int
    finished_at: int
    exit_code: int
    image: ImageSpec
    image_ref: str
    reason: str
    message: str
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    log_path: str
    resources: ContainerResources
    image_id: str
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[ContainerMetadata, _Mapping]] = ..., state: _Optional[_Union[ContainerState, str]] = ..., created_at: _Optional[int] = ..., started_at: _Optional[int] = ..., finished_at: _Optional[int] = ..., exit_code: _Optional[int] = ..., image: _Optional[_Union[ImageSpec, _Mapping]] = ..., image_ref: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., log_path: _Optional[str] = ..., resources: _Optional[_Union[ContainerResources, _Mapping]] = ..., image_id: _Optional[str] = ...) -> None: ...

class ContainerResources(_message.Message):
    __slots__ = ("linux",)
    LINUX_FIELD_NUMBER: _ClassVar[int]
    linux: LinuxContainerResources
    def __init__(self, linux: _Optional[_Union[LinuxContainerResources, _Mapping]] = ...) -> None: ...

class UpdateContainerResourcesRequest(_message.Message):
    __slots__ = ("container_id", "linux")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    LINUX_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    linux: LinuxContainerResources
    def __init__(self, container_id: _Optional[str] = ..., linux: _Optional[_Union[LinuxContainerResources, _Mapping]] = ...) -> None: ...

class UpdateContainerResourcesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatusResponse(_message.Message):
    __slots__ = ("status", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    status: ContainerStatus
    info: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[_Union[ContainerStatus, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("id", "repo_tags", "repo_digests", "size", "uid", "username", "spec", "pinned")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPO_TAGS_FIELD_NUMBER: _ClassVar[int]
    REPO_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    id: str
    repo_tags: _containers.RepeatedScalarFieldContainer[str]
    repo_digests: _containers.RepeatedScalarFieldContainer[str]
    size: int
    uid: Int64Value
    username: str
    spec: ImageSpec
    pinned: bool
    def __init__(self, id: _Optional[str] = ..., repo_tags: _Optional[_Iterable[str]] = ..., repo_digests: _Optional[_Iterable[str]] = ..., size: _Optional[int] = ..., uid: _Optional[_Union[Int64Value, _Mapping]] = ..., username: _Optional[str] = ..., spec: _Optional[_Union[ImageSpec, _Mapping]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ImageFilter(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: ImageFilter
    def __init__(self, filter: _Optional[_Union[ImageFilter, _Mapping]] = ...) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class ImageStatusRequest(_message.Message):
    __slots__ = ("image", "verbose")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    verbose: bool
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ..., verbose: _Optional[bool] = ...) -> None: ...

class ImageStatusResponse(_message.Message):
    __slots__ = ("image", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    image: Image
    info: _containers.ScalarMap[str, str]
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AuthConfig(_message.Message):
    __slots__ = ("username", "password", "auth", "server_address", "identity_token", "registry_token")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    auth: str
    server_address: str
    identity_token: str
    registry_token: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ..., auth: _Optional[str] = ..., server_address: _Optional[str] = ..., identity_token: _Optional[str] = ..., registry_token: _Optional[str] = ...) -> None: ...

class PullImageRequest(_message.Message):
    __slots__ = ("image", "auth", "sandbox_config")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_CONFIG_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    auth: AuthConfig
    sandbox_config: PodSandboxConfig
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ..., auth: _Optional[_Union[AuthConfig, _Mapping]] = ..., sandbox_config: _Optional[_Union[PodSandboxConfig, _Mapping]] = ...) -> None: ...

class PullImageResponse(_message.Message):
    __slots__ = ("image_ref",)
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    image_ref: str
    def __init__(self, image_ref: _Optional[str] = ...) -> None: ...

class RemoveImageRequest(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ...) -> None: ...

class RemoveImageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageFsInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageFsInfoResponse(_message.Message):
    __slots__ = ("image_filesystems", "container_filesystems")
    IMAGE_FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    image_filesystems: _containers.RepeatedCompositeFieldContainer[FilesystemUsage]
    container_filesystems: _containers.RepeatedCompositeFieldContainer[FilesystemUsage]
    def __init__(self, image_filesystems: _Optional[_Iterable[_Union[FilesystemUsage, _Mapping]]] = ..., container_filesystems: _Optional[_Iterable[_Union[FilesystemUsage, _Mapping]]] = ...) -> None: ...

class ReopenContainerLogRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class ReopenContainerLogResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecSyncRequest(_message.Message):
    __slots__ = ("container_id", "cmd", "timeout")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    cmd: _containers.RepeatedScalarFieldContainer[str]
    timeout: int
    def __init__(self, container_id: _Optional[str] = ..., cmd: _Optional[_Iterable[str]] = ..., timeout: _Optional[int] = ...) -> None: ...

class ExecSyncResponse(_message.Message):
    __slots__ = ("stdout", "stderr", "exit_code")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit_code: int
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit_code: _Optional[int] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("container_id", "cmd", "tty", "stdin", "stdout", "stderr")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    TTY_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    cmd: _containers.RepeatedScalarFieldContainer[str]
    tty: bool
    stdin: bool
    stdout: bool
    stderr: bool
    def __init__(self, container_id: _Optional[str] = ..., cmd: _Optional[_Iterable[str]] = ..., tty: _Optional[bool] = ..., stdin: _Optional[bool] = ..., stdout: _Optional[bool] = ..., stderr: _Optional[bool] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("container_id", "stdin", "tty", "stdout", "stderr")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TTY_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    stdin: bool
    tty: bool
    stdout: bool
    stderr: bool
    def __init__(self, container_id: _Optional[str] = ..., stdin: _Optional[bool] = ..., tty: _Optional[bool] = ..., stdout: _Optional[bool] = ..., stderr: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class PortForwardRequest(_message.Message):
    __slots__ = ("pod_sandbox_id", "port")
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    port: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pod_sandbox_id: _Optional[str] = ..., port: _Optional[_Iterable[int]] = ...) -> None: ...

class PortForwardResponse(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class UInt64Value(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class ContainerStatsFilter(_message.Message):
    __slots__ = ("id", "pod_sandbox_id", "label_selector")
    class LabelSelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    pod_sandbox_id: str
    label_selector: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., pod_sandbox_id: _Optional[str] = ..., label_selector: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListContainerStatsRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: ContainerStatsFilter
    def __init__(self, filter: _Optional[_Union[ContainerStatsFilter, _Mapping]] = ...) -> None: ...

class ContainerAttributes(_message.Message):
    __slots__ = ("id", "metadata", "labels", "annotations")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: ContainerMetadata
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[ContainerMetadata, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CpuUsage(_message.Message):
    __slots__ = ("timestamp", "usage_core_nano_seconds", "usage_nano_cores")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    USAGE_CORE_NANO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_NANO_CORES_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    usage_core_nano_seconds: UInt64Value
    usage_nano_cores: UInt64Value
    def __init__(self, timestamp: _Optional[int] = ..., usage_core_nano_seconds: _Optional[_Union[UInt64Value, _Mapping]] = ..., usage_nano_cores: _Optional[_Union[UInt64Value, _Mapping]] = ...) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("timestamp", "working_set_bytes", "available_bytes", "usage_bytes", "rss_bytes", "page_faults", "major_page_faults")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_FAULTS_FIELD_NUMBER: _ClassVar[int]
    MAJOR_PAGE_FAULTS_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    working_set_bytes: UInt64Value
    available_bytes: UInt64Value
    usage_bytes: UInt64Value
    rss_bytes: UInt64Value
    page_faults: UInt64Value
    major_page_faults: UInt64Value
    def __init__(self, timestamp: _Optional[int] = ..., working_set_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., available_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., usage_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., rss_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., page_faults: _Optional[_Union[UInt64Value, _Mapping]] = ..., major_page_faults: _Optional[_Union[UInt64Value, _Mapping]] = ...) -> None: ...

class FilesystemIdentifier(_message.Message):
    __slots__ = ("mountpoint",)
    MOUNTPOINT_FIELD_NUMBER: _ClassVar[int]
    mountpoint: str
    def __init__(self, mountpoint: _Optional[str] = ...) -> None: ...

class FilesystemUsage(_message.Message):
    __slots__ = ("timestamp", "fs_id", "used_bytes", "inodes_used")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FS_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INODES_USED_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    fs_id: FilesystemIdentifier
    used_bytes: UInt64Value
    inodes_used: UInt64Value
    def __init__(self, timestamp: _Optional[int] = ..., fs_id: _Optional[_Union[FilesystemIdentifier, _Mapping]] = ..., used_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., inodes_used: _Optional[_Union[UInt64Value, _Mapping]] = ...) -> None: ...

class ContainerStats(_message.Message):
    __slots__ = ("attributes", "cpu", "memory", "writable_layer")
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_LAYER_FIELD_NUMBER: _ClassVar[int]
    attributes: ContainerAttributes
    cpu: CpuUsage
    memory: MemoryUsage
    writable_layer: FilesystemUsage
    def __init__(self, attributes: _Optional[_Union[ContainerAttributes, _Mapping]] = ..., cpu: _Optional[_Union[CpuUsage, _Mapping]] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., writable_layer: _Optional[_Union[FilesystemUsage, _Mapping]] = ...) -> None: ...

class ListContainerStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.RepeatedCompositeFieldContainer[ContainerStats]
    def __init__(self, stats: _Optional[_Iterable[_Union[ContainerStats, _Mapping]]] = ...) -> None: ...

class GetEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerEventResponse(_message.Message):
    __slots__ = ("container_id", "container_event_type", "created_at", "pod_sandbox_status", "containers_statuses")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    POD_SANDBOX_STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_STATUSES_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    container_event_type: ContainerEventType
    created_at: int
    pod_sandbox_status: PodSandboxStatus
    containers_statuses: _containers.RepeatedCompositeFieldContainer[ContainerStatus]
    def __init__(self, container_id: _Optional[str] = ..., container_event_type: _Optional[_Union[ContainerEventType, str]] = ..., created_at: _Optional[int] = ..., pod_sandbox_status: _Optional[_Union[PodSandboxStatus, _Mapping]] = ..., containers_statuses: _Optional[_Iterable[_Union[ContainerStatus, _Mapping]]] = ...) -> None: ...
