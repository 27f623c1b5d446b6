"""The table of pod spec fields: what ordinary pods carry is accepted, what the agent
does not honour (or does not know) is named by its path."""

from __future__ import annotations

from typing import Any

from nodeagent.pods import podspec
from nodeagent.pods.podspec import unhandled
from tests.conftest import mkpod


def api_server_pod() -> dict[str, Any]:
    """A pod as the API server stores it after defaulting and admission: every default
    it fills in, the service-account token volume, tolerations, priority."""
    pod = mkpod("web", containers=[{
        "name": "c", "image": "localhost/busybox:1", "command": ["sleep", "1"],
        "resources": {}, "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
        "volumeMounts": [{"name": "kube-api-access-x", "readOnly": True,
                          "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}])
    pod["spec"].update({
        "volumes": [{"name": "kube-api-access-x", "projected": {"defaultMode": 420,
                                                              "sources": []}}],
        "dnsPolicy": "ClusterFirst", "serviceAccountName": "default",
        "serviceAccount": "default", "securityContext": {}, "schedulerName": "default-scheduler",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                         "effect": "NoExecute", "tolerationSeconds": 300}],
        "priority": 0, "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
        "terminationGracePeriodSeconds": 30})
    return pod


def test_an_ordinary_pod_has_nothing_unhandled() -> None:
    assert unhandled(api_server_pod()) == []


def test_scheduler_fields_are_accepted() -> None:
    pod = api_server_pod()
    pod["spec"].update({"nodeSelector": {"a": "b"}, "affinity": {"nodeAffinity": {}},
                        "topologySpreadConstraints": [{"maxSkew": 1}],
                        "schedulingGates": [{"name": "g"}], "priorityClassName": "high"})
    assert unhandled(pod) == []


def test_fields_owned_by_other_modules_are_not_refused_here() -> None:
    c = {"name": "c", "image": "i", "envFrom": [{"configMapRef": {"name": "x"}}],
         "livenessProbe": {"exec": {"command": ["true"]}}, "readinessProbe": {},
         "startupProbe": {"tcpSocket": {"port": 1}}, "lifecycle": {"preStop": {}}}
    pod = mkpod("p", containers=[c], initContainers=[dict(c, name="i", restartPolicy="Always")],
                activeDeadlineSeconds=5, readinessGates=[{"conditionType": "x"}],
                imagePullSecrets=[{"name": "s"}], dnsConfig={"searches": ["a"]},
                hostAliases=[{"ip": "1.2.3.4", "hostnames": ["a"]}])
    assert unhandled(pod) == []


def test_refused_fields_are_named_by_path_and_container() -> None:
    pod = mkpod("p", containers=("a", {"name": "b", "image": "i",
                                       "volumeDevices": [{"name": "v", "devicePath": "/d"}],
                                       "securityContext": {"procMount": "Unmasked"},
                                       "lifecycle": {"stopSignal": "SIGUSR1"},
                                       "restartPolicy": "Always"}),
                hostUsers=False)
    got = {(u.path, u.container) for u in unhandled(pod)}
    assert got == {("spec.hostUsers", None), ("spec.containers[1].volumeDevices", "b"),
                   ("spec.containers[1].securityContext.procMount", "b"),
                   ("spec.containers[1].lifecycle.stopSignal", "b"),
                   ("spec.containers[1].restartPolicy", "b")}
    [u] = [u for u in unhandled(pod) if u.container == "b" and "Devices" in u.path]
    assert u.message.startswith("spec.containers[1].volumeDevices: raw block devices")


def test_defaults_and_empty_values_are_not_refused() -> None:
    pod = mkpod("p", containers=[{"name": "c", "image": "i", "volumeDevices": [],
                                  "securityContext": {"procMount": "Default"},
                                  "resources": {"limits": {"cpu": "1"}}}],
                hostUsers=True, ephemeralContainers=[])
    assert unhandled(pod) == []


def test_unknown_fields_are_refused() -> None:
    pod = mkpod("p", containers=[{"name": "c", "image": "i", "futureThing": {"x": 1}}],
                futurePodField=True)
    pod["spec"]["securityContext"] = {"futureSecurity": "on"}
    paths = {u.path for u in unhandled(pod)}
    assert paths == {"spec.futurePodField", "spec.containers[0].futureThing",
                     "spec.securityContext.futureSecurity"}
    assert all(u.why == podspec.UNKNOWN for u in unhandled(pod))


def test_init_containers_and_claims() -> None:
    pod = mkpod("p", initContainers=[{"name": "i", "image": "x",
                                      "resources": {"claims": [{"name": "gpu"}]}}],
                resourceClaims=[{"name": "gpu"}])
    got = {(u.path, u.container) for u in unhandled(pod)}
    assert got == {("spec.initContainers[0].resources", "i"), ("spec.resourceClaims", None)}


def test_every_api_field_is_in_the_tables() -> None:
    """The PodSpec, Container and security-context fields of the API this agent is
    built against (Kubernetes v1.35) each have a row."""
    pod_spec = ("volumes initContainers containers ephemeralContainers restartPolicy "
                "terminationGracePeriodSeconds activeDeadlineSeconds dnsPolicy nodeSelector "
                "serviceAccountName serviceAccount automountServiceAccountToken nodeName "
                "hostNetwork hostPID hostIPC shareProcessNamespace securityContext "
                "imagePullSecrets hostname subdomain affinity schedulerName tolerations "
                "hostAliases priorityClassName priority dnsConfig readinessGates "
                "runtimeClassName enableServiceLinks preemptionPolicy overhead "
                "topologySpreadConstraints setHostnameAsFQDN os hostUsers schedulingGates "
                "resourceClaims resources hostnameOverride workloadRef")
    container = ("name image command args workingDir ports envFrom env resources "
                 "resizePolicy restartPolicy restartPolicyRules volumeMounts volumeDevices "
                 "livenessProbe readinessProbe startupProbe lifecycle terminationMessagePath "
                 "terminationMessagePolicy imagePullPolicy securityContext stdin stdinOnce tty")
    pod_sc = ("seLinuxOptions windowsOptions runAsUser runAsGroup runAsNonRoot "
              "supplementalGroups supplementalGroupsPolicy fsGroup sysctls "
              "fsGroupChangePolicy seccompProfile appArmorProfile seLinuxChangePolicy")
    sc = ("capabilities privileged seLinuxOptions windowsOptions runAsUser runAsGroup "
          "runAsNonRoot readOnlyRootFilesystem allowPrivilegeEscalation procMount "
          "seccompProfile appArmorProfile")
    assert set(pod_spec.split()) == set(podspec.POD_FIELDS)
    assert set(container.split()) == set(podspec.CONTAINER_FIELDS)
    assert set(pod_sc.split()) == set(podspec.POD_SECURITY_FIELDS)
    assert set(sc.split()) == set(podspec.SECURITY_FIELDS)
