"""The Kubernetes Pod Security Standards, `baseline` and `restricted` profiles (latest version), as
checks of one pod spec: what the Pod Security admission controller enforces on a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`, from
https://kubernetes.io/docs/concepts/security/pod-security-standards/. Used by tests/unit/test_k8s.py
beside checkov, which checks other things and not all of these."""

from __future__ import annotations

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict) -> list[str]:
    """Every rule of `restricted` (which includes `baseline`) that the pod spec breaks, named."""
    return baseline_violations(spec) + _restricted_only(spec)


def baseline_violations(spec: dict) -> list[str]:
    found = [f"{key} is set" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    pod = spec.get("securityContext", {})
    found += _context_violations("pod", pod)
    found += [f"sysctl {s['name']} is not safe" for s in pod.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    found += [f"volume {v['name']} is a hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    for c in containers(spec):
        context = c.get("securityContext", {})
        found += _context_violations(f"container {c['name']}", context)
        if context.get("privileged"):
            found.append(f"container {c['name']} is privileged")
        added = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        found += [f"container {c['name']} adds capability {cap}" for cap in sorted(added)]
        found += [f"container {c['name']} has hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
        if context.get("procMount", "Default") != "Default":
            found.append(f"container {c['name']} has procMount {context['procMount']}")
    return found


def _context_violations(where: str, context: dict) -> list[str]:
    found = []
    if context.get("windowsOptions", {}).get("hostProcess"):
        found.append(f"{where}: windowsOptions.hostProcess")
    if context.get("seccompProfile", {}).get("type") == "Unconfined":
        found.append(f"{where}: seccompProfile Unconfined")
    if context.get("appArmorProfile", {}).get("type") == "Unconfined":
        found.append(f"{where}: appArmorProfile Unconfined")
    selinux = context.get("seLinuxOptions", {})
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append(f"{where}: seLinuxOptions {selinux}")
    return found


def _restricted_only(spec: dict) -> list[str]:
    pod = spec.get("securityContext", {})
    found = [f"volume {v['name']} is of a type restricted refuses" for v in spec.get("volumes", [])
             if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if pod.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for c in containers(spec):
        context, name = c.get("securityContext", {}), c["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"container {name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            found.append(f"container {name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"container {name}: runAsUser 0")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"container {name}: seccompProfile {seccomp}, not RuntimeDefault or Localhost")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"container {name}: capabilities do not drop ALL")
        found += [f"container {name} adds {cap}" for cap in capabilities.get("add", []) if cap != "NET_BIND_SERVICE"]
    return found
