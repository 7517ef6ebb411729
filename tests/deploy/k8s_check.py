"""Renders deploy/k8s's overlays with `kubectl kustomize`, lints sources and renders
with yamllint, and checks the rendered objects (ctest label "deploy"):

- every container (fwserve and Redis) has startup, readiness and liveness probes, cpu
  and memory requests, a memory limit, and a securityContext with runAsNonRoot,
  readOnlyRootFilesystem, allowPrivilegeEscalation: false, capabilities drop ALL and
  seccomp RuntimeDefault (container or pod level);
- fwserve: every --flag in its args is a flag of the real binary (`fwserve --help`);
  the "grpc", "http" and "metrics" container ports are --listen's, --http-listen's and
  --metrics-listen's ports; readiness is an HTTP GET of /ready on the http port,
  startup a GET of /ready or /health there or the gRPC health check on --listen's port,
  liveness a GET of /health or the gRPC health check (never /ready);
  terminationGracePeriodSeconds exceeds the preStop sleep plus
  --drain-timeout plus a margin to persist sessions; every file flag points into a
  mounted Secret that holds that file;
- every Secret and ConfigMap referenced (volumes, env, envFrom) is in the render, with
  the referenced key; every $(VAR) in args is defined; Services, the PDB, the
  NetworkPolicy and the HPA select or target objects of the render;
- the front doors: a ClusterIP Service of the fwserve pods has ports to "grpc" and to
  "http"; a NetworkPolicy of those pods admits both; every GRPCRoute/HTTPRoute sends
  to a port of a Service of the render whose target is "grpc"/"http"; with a GRPCRoute
  there is an HTTPRoute too, and their hostnames do not overlap (the Gateway API
  rejects a GRPCRoute and an HTTPRoute with a common hostname on one listener);
- the store decides the shape: dir: means one replica, strategy Recreate, a mounted
  PersistentVolumeClaim of the render, no autoscaler; redis:// means several replicas,
  an HPA on cpu and on a pods metric, a headless Service, and a Redis StatefulSet with
  append-only persistence (or an external URL).

The kustomizations are written for kustomize v2.0.3 (built into Debian 12's kubectl
1.20, package kubernetes-client) and render the same objects with newer kustomize; the
checks do not depend on what differs between versions: the order of the objects, the
generated Secrets' name hashes, and the wrapping of base64 data (kustomize v5 breaks it
into 70-column lines, v2.0.3 writes one long line, which the render's lint allows).

Usage: k8s_check.py --repo DIR --fwserve PATH [--kubectl PATH] [--yamllint PATH] OVERLAY...
Exit 77 (ctest SKIP_RETURN_CODE) when kubectl is not installed.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

try:
    import yaml
except ImportError:
    print("k8s_check: python3-yaml is missing (Debian's yamllint depends on it; "
          "scripts/install-deps.sh installs yamllint)")
    print("0 passed, 1 failed")
    sys.exit(1)

SKIP_CODE = 77
# Extra time for the last sessions to reach the store after the drain.
PERSIST_MARGIN_S = 10
FILE_FLAGS = ("api-keys-file", "session-key-file", "session-store-password-file",
              "tls-cert-file", "tls-key-file", "tls-client-ca-file")


def duration_s(text):
    """'30s', '2m', '1m30s', '500ms' -> seconds."""
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError("not a duration: %r" % text)
    for number, unit in parts:
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def parse_flags(args):
    flags = {}
    for arg in args:
        match = re.match(r"--([a-z0-9_-]+)(?:=(.*))?$", arg)
        if match:
            flags[match.group(1).replace("_", "-")] = match.group(2)
    return flags


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def known_flags(fwserve):
    out = subprocess.run([fwserve, "--helpfull"], capture_output=True, text=True)
    names = set(re.findall(r"^\s+--([a-z0-9_]+) ", out.stdout + out.stderr, re.M))
    return {name.replace("_", "-") for name in names}


def kubectl_version(kubectl):
    """'kubectl v1.32.4, kustomize v5.5.0' (kubectl before 1.21 does not report its
    kustomize, v2.0.3 in every such release)."""
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"],
                         capture_output=True, text=True)
    try:
        info = json.loads(out.stdout)
    except ValueError:
        return "kubectl of unknown version (%s)" % (out.stderr.strip() or out.stdout.strip())
    version = info.get("clientVersion", {}).get("gitVersion", "?")
    kustomize = info.get("kustomizeVersion")
    if not kustomize:
        minor = re.match(r"v1\.(\d+)\.", version)
        kustomize = "v2.0.3 (built into kubectl < 1.21)" if minor and int(
            minor.group(1)) < 21 else "unknown"
    return "kubectl %s, kustomize %s" % (version, kustomize)


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class Checker:
    def __init__(self, name):
        self.name = name
        self.problems = []
        self.checks = 0

    def expect(self, condition, message):
        self.checks += 1
        if not condition:
            self.problems.append("%s: %s" % (self.name, message))
        return condition


def pod_templates(objects):
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj, obj["spec"]["template"]


def check_container_basics(c, where, container, pod_spec):
    pod_sc = pod_spec.get("securityContext", {})
    sc = container.get("securityContext", {})
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        c.expect(probe in container, "%s: no %s" % (where, probe))
    resources = container.get("resources", {})
    for kind in ("cpu", "memory"):
        c.expect(kind in resources.get("requests", {}), "%s: no %s request" % (where, kind))
    c.expect("memory" in resources.get("limits", {}), "%s: no memory limit" % where)
    c.expect(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
             "%s: runAsNonRoot is not true" % where)
    c.expect(sc.get("readOnlyRootFilesystem") is True, "%s: root filesystem writable" % where)
    c.expect(sc.get("allowPrivilegeEscalation") is False,
             "%s: allowPrivilegeEscalation is not false" % where)
    c.expect("ALL" in sc.get("capabilities", {}).get("drop", []),
             "%s: capabilities do not drop ALL" % where)
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
    c.expect(seccomp.get("type") == "RuntimeDefault", "%s: seccomp is not RuntimeDefault" % where)


def check_references(c, where, container, pod_spec, by_kind):
    secrets, configmaps = by_kind.get("Secret", {}), by_kind.get("ConfigMap", {})

    def has_key(store, name, key):
        obj = store.get(name)
        if obj is None:
            return False
        return key is None or key in obj.get("data", {}) or key in obj.get("stringData", {})

    for volume in pod_spec.get("volumes", []):
        for kind, store, field in (("secret", secrets, "secretName"),
                                   ("configMap", configmaps, "name")):
            if kind in volume:
                name = volume[kind][field]
                c.expect(name in store, "%s: volume %s: %s %s not in the render" % (
                    where, volume["name"], kind, name))
                for item in volume[kind].get("items", []):
                    c.expect(has_key(store, name, item["key"]), "%s: %s %s has no key %s" % (
                        where, kind, name, item["key"]))
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            c.expect(claim in by_kind.get("PersistentVolumeClaim", {}),
                     "%s: PersistentVolumeClaim %s not in the render" % (where, claim))
    env_names = set()
    for env in container.get("env", []):
        env_names.add(env["name"])
        ref = env.get("valueFrom", {})
        if "secretKeyRef" in ref:
            r = ref["secretKeyRef"]
            c.expect(has_key(secrets, r["name"], r["key"]), "%s: env %s: Secret %s key %s "
                     "not in the render" % (where, env["name"], r["name"], r["key"]))
        if "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            c.expect(has_key(configmaps, r["name"], r["key"]), "%s: env %s: ConfigMap %s "
                     "key %s not in the render" % (where, env["name"], r["name"], r["key"]))
    for source in container.get("envFrom", []):
        for kind, store in (("secretRef", secrets), ("configMapRef", configmaps)):
            if kind in source:
                c.expect(source[kind]["name"] in store, "%s: envFrom %s %s not in the render"
                         % (where, kind, source[kind]["name"]))
    for arg in container.get("args", []) + container.get("command", []):
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            c.expect(var in env_names, "%s: $(%s) in args is not in env" % (where, var))


def mounted_file_source(container, pod_spec, path, by_kind):
    """(Secret or ConfigMap object, key) that provides the file `path`, or None."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix) or "subPath" in mount:
            continue
        relative = path[len(prefix):]
        volume = volumes.get(mount["name"], {})
        for kind, field, store in (("secret", "secretName", "Secret"),
                                   ("configMap", "name", "ConfigMap")):
            if kind not in volume:
                continue
            obj = by_kind.get(store, {}).get(volume[kind][field])
            if obj is None:
                return None
            items = volume[kind].get("items")
            key = relative
            if items:
                key = next((i["key"] for i in items if i["path"] == relative), None)
            data = dict(obj.get("data", {}), **obj.get("stringData", {}))
            return (obj, key) if key in data else None
    return None


def check_fwserve(c, where, obj, pod_spec, container, flags_known, by_kind):
    flags = parse_flags(container.get("args", []))
    for flag in flags:
        c.expect(flag in flags_known, "%s: --%s is not a flag of fwserve (fwserve --help)" % (
            where, flag))
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    listen, metrics = flags.get("listen"), flags.get("metrics-listen")
    http = flags.get("http-listen")
    if c.expect(listen is not None, "%s: no --listen" % where):
        c.expect(not listen.startswith("127."), "%s: --listen=%s is loopback only" % (where,
                                                                                   listen))
        c.expect(ports.get("grpc") == port_of(listen), "%s: port grpc %s != --listen %s" % (
            where, ports.get("grpc"), listen))
    if c.expect(http, "%s: no --http-listen (the OpenAI-compatible HTTP API)" % where):
        c.expect(not http.startswith("127."), "%s: --http-listen=%s is loopback only" % (
            where, http))
        c.expect(ports.get("http") == port_of(http), "%s: port http %s != --http-listen %s" % (
            where, ports.get("http"), http))

    def probe_is(probe, grpc_ok, http_paths):
        """The probe is the gRPC health check on --listen's port (if grpc_ok), or an
        HTTP GET of one of http_paths on --http-listen's port."""
        spec = container.get(probe, {})
        if "grpc" in spec:
            return grpc_ok and listen is not None and spec["grpc"].get("port") in (
                port_of(listen), "grpc")
        get = spec.get("httpGet")
        if get is not None:
            return (http is not None and get.get("port") in (port_of(http), "http")
                    and get.get("path") in http_paths and get.get("scheme", "HTTP") == "HTTP")
        return False

    c.expect(probe_is("readinessProbe", False, ("/ready",)),
             "%s: readinessProbe is not an HTTP GET of /ready on the --http-listen port "
             "(503 from SIGTERM on)" % where)
    c.expect(probe_is("startupProbe", True, ("/ready", "/health")),
             "%s: startupProbe is neither a GET of /ready or /health on the --http-listen "
             "port nor a gRPC probe on the --listen port" % where)
    c.expect(probe_is("livenessProbe", True, ("/health",)),
             "%s: livenessProbe is neither a GET of /health on the --http-listen port nor a "
             "gRPC probe on the --listen port" % where)
    if c.expect(metrics, "%s: no --metrics-listen" % where):
        c.expect(ports.get("metrics") == port_of(metrics), "%s: port metrics %s != "
                 "--metrics-listen %s" % (where, ports.get("metrics"), metrics))
        annotation = obj["spec"]["template"]["metadata"].get("annotations", {}).get(
            "prometheus.io/port")
        c.expect(annotation in (None, str(port_of(metrics))),
                 "%s: prometheus.io/port %s != --metrics-listen" % (where, annotation))
    # Grace period > preStop sleep + drain + margin.
    drain = duration_s(flags.get("drain-timeout") or "30s")
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    c.expect(pre_stop, "%s: no preStop (endpoints are removed while fwserve drains)" % where)
    sleep = 0.0
    command = pre_stop.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0].endswith("sleep"):
        sleep = float(command[1])
    if "sleep" in pre_stop:
        sleep = float(pre_stop["sleep"]["seconds"])
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    c.expect(grace > sleep + drain + PERSIST_MARGIN_S,
             "%s: terminationGracePeriodSeconds %s <= preStop %g s + --drain-timeout %g s + "
             "%d s to persist" % (where, grace, sleep, drain, PERSIST_MARGIN_S))
    # File flags: a file in a mounted Secret/ConfigMap of the render.
    for flag in FILE_FLAGS:
        path = flags.get(flag)
        if path:
            c.expect(mounted_file_source(container, pod_spec, path, by_kind) is not None,
                     "%s: --%s=%s is not a file of a mounted Secret/ConfigMap of the render"
                     % (where, flag, path))
    return flags


def check_shape(c, objects, by_kind, deployment, flags, container):
    store = flags.get("session-store") or "memory"
    env = {e["name"]: e for e in container.get("env", [])}
    for var in re.findall(r"\$\(([A-Za-z_0-9]+)\)", store):
        ref = env.get(var, {}).get("valueFrom", {}).get("secretKeyRef")
        data = by_kind.get("Secret", {}).get(ref["name"], {}).get("data", {}) if ref else {}
        if ref and ref["key"] in data:  # else check_references reports a missing key
            import base64
            # b64decode skips the newlines of kustomize v5's wrapped values.
            store = base64.b64decode(data[ref["key"]]).decode()
    replicas = deployment["spec"].get("replicas", 1)
    hpas = [h for h in by_kind.get("HorizontalPodAutoscaler", {}).values()
            if h["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]]
    if store.startswith("dir:"):
        path = store[len("dir:"):]
        c.expect(replicas == 1, "dir: store with %s replicas (the directory is locked by one "
                 "server)" % replicas)
        c.expect(deployment["spec"].get("strategy", {}).get("type") == "Recreate",
                 "dir: store without strategy Recreate")
        c.expect(not hpas, "dir: store with an autoscaler")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get(
            "volumes", [])}
        mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
        c.expect(mounts and "persistentVolumeClaim" in volumes.get(mounts[0]["name"], {}),
                 "the session directory %s is not on a PersistentVolumeClaim" % path)
    elif store.startswith("redis://"):
        c.expect(replicas >= 2, "redis:// store with %s replica(s)" % replicas)
        c.expect(bool(hpas), "redis:// store without a HorizontalPodAutoscaler")
        for hpa in hpas:
            kinds = {m["type"] for m in hpa["spec"].get("metrics", [])}
            c.expect({"Resource", "Pods"} <= kinds, "HPA metrics %s lack cpu or pods" % kinds)
            c.expect(hpa["spec"].get("minReplicas", 1) >= 2, "HPA minReplicas < 2")
        c.expect(any(s["spec"].get("clusterIP") == "None" and selects(
            s["spec"].get("selector"), deployment["spec"]["template"]["metadata"]["labels"])
            for s in by_kind.get("Service", {}).values()), "no headless Service for fwserve")
        host = store[len("redis://"):].split("/")[0].split(":")[0]
        redis = by_kind.get("StatefulSet", {})
        if any(host.startswith(name) for name in redis):
            for name, sts in redis.items():
                args = " ".join(sts["spec"]["template"]["spec"]["containers"][0].get("args", []))
                c.expect("--appendonly yes" in args, "StatefulSet %s: Redis without "
                         "--appendonly yes" % name)
                c.expect(bool(sts["spec"].get("volumeClaimTemplates")),
                         "StatefulSet %s: no volumeClaimTemplates" % name)
    else:
        c.expect(False, "--session-store=%s: sessions would not survive a restart" % store)


def check_selectors(c, objects, by_kind):
    templates = [t["metadata"].get("labels", {}) for _, t in pod_templates(objects)]
    for name, svc in by_kind.get("Service", {}).items():
        c.expect(any(selects(svc["spec"].get("selector"), t) for t in templates),
                 "Service %s selects no pod template" % name)
        target_names = set()
        for _, t in pod_templates(objects):
            if selects(svc["spec"].get("selector"), t["metadata"].get("labels", {})):
                for ct in t["spec"]["containers"]:
                    target_names |= {p.get("name") for p in ct.get("ports", [])}
                    target_names |= {p["containerPort"] for p in ct.get("ports", [])}
        for port in svc["spec"]["ports"]:
            c.expect(port.get("targetPort", port["port"]) in target_names,
                     "Service %s port %s: targetPort %s is no container port" % (
                         name, port.get("name"), port.get("targetPort")))
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for name, obj in by_kind.get(kind, {}).items():
            selector = obj["spec"].get("selector", obj["spec"].get("podSelector", {}))
            c.expect(any(selects(selector.get("matchLabels"), t) for t in templates),
                     "%s %s selects no pod template" % (kind, name))
    for name, hpa in by_kind.get("HorizontalPodAutoscaler", {}).items():
        ref = hpa["spec"]["scaleTargetRef"]
        c.expect(ref["name"] in by_kind.get(ref["kind"], {}),
                 "HPA %s targets %s %s, not in the render" % (name, ref["kind"], ref["name"]))
    c.expect("PodDisruptionBudget" in by_kind, "no PodDisruptionBudget")
    c.expect("NetworkPolicy" in by_kind, "no NetworkPolicy")
    c.expect("PodMonitor" in by_kind or "ServiceMonitor" in by_kind,
             "no PodMonitor or ServiceMonitor")


def hostnames_overlap(a, b):
    """Whether two routes' hostname lists share a hostname (empty: every hostname)."""
    if not a or not b:
        return True

    def match(x, y):  # "*.example.com" covers "a.example.com" and "*.a.example.com"
        return x == y or any(w.startswith("*.") and v.endswith(w[1:])
                             for w, v in ((x, y), (y, x)))
    return any(match(x, y) for x in a for y in b)


def check_front_doors(c, objects, by_kind, template, container):
    """The gRPC and HTTP ports reach the fwserve pods: Service, NetworkPolicy, routes."""
    labels = template["metadata"].get("labels", {})
    numbers = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}

    def is_port(value, name):
        return value is not None and value in (name, numbers.get(name))

    services = {n: s for n, s in by_kind.get("Service", {}).items()
                if selects(s["spec"].get("selector"), labels)}
    cluster_ip = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    for name in ("grpc", "http"):
        c.expect(any(is_port(p.get("targetPort", p["port"]), name)
                     for s in cluster_ip for p in s["spec"]["ports"]),
                 "no ClusterIP Service of the fwserve pods has a port to container port %s"
                 % name)
        c.expect(any(is_port(p.get("port"), name)
                     for np in by_kind.get("NetworkPolicy", {}).values()
                     if selects(np["spec"].get("podSelector", {}).get("matchLabels"), labels)
                     for rule in np["spec"].get("ingress", [])
                     for p in rule.get("ports", [])),
                 "no NetworkPolicy of the fwserve pods admits port %s" % name)
    routes = {kind: by_kind.get(kind, {}) for kind in ("GRPCRoute", "HTTPRoute")}
    for kind, target in (("GRPCRoute", "grpc"), ("HTTPRoute", "http")):
        for name, route in routes[kind].items():
            for rule in route["spec"].get("rules", []):
                for ref in rule.get("backendRefs", []):
                    service = services.get(ref["name"]) if ref.get("kind", "Service") == (
                        "Service") else None
                    ports = [p for p in (service or {}).get("spec", {}).get("ports", [])
                             if p["port"] == ref.get("port")]
                    c.expect(bool(ports) and is_port(ports[0].get("targetPort",
                                                                  ports[0]["port"]), target),
                             "%s %s: backendRef %s:%s is not a port of a fwserve Service "
                             "to container port %s" % (kind, name, ref["name"],
                                                       ref.get("port"), target))
    if routes["GRPCRoute"]:
        c.expect(bool(routes["HTTPRoute"]), "a GRPCRoute but no HTTPRoute for the HTTP API")
    for g_name, g in routes["GRPCRoute"].items():
        for h_name, h in routes["HTTPRoute"].items():
            parents = {p["name"] for p in g["spec"].get("parentRefs", [])} & {
                p["name"] for p in h["spec"].get("parentRefs", [])}
            c.expect(not parents or not hostnames_overlap(g["spec"].get("hostnames"),
                                                          h["spec"].get("hostnames")),
                     "GRPCRoute %s and HTTPRoute %s share parent %s and a hostname (%s, %s): "
                     "the Gateway API rejects one of them" % (
                         g_name, h_name, sorted(parents), g["spec"].get("hostnames"),
                         h["spec"].get("hostnames")))


def check_overlay(overlay, rendered, flags_known):
    c = Checker(os.path.basename(overlay.rstrip("/")))
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    fwserve_seen = False
    for obj, template in pod_templates(objects):
        pod_spec = template["spec"]
        for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            where = "%s %s container %s" % (obj["kind"], obj["metadata"]["name"],
                                            container["name"])
            check_container_basics(c, where, container, pod_spec)
            check_references(c, where, container, pod_spec, by_kind)
            if container["name"] == "fwserve":
                fwserve_seen = True
                flags = check_fwserve(c, where, obj, pod_spec, container, flags_known, by_kind)
                check_shape(c, objects, by_kind, obj, flags, container)
                check_front_doors(c, objects, by_kind, template, container)
    c.expect(fwserve_seen, "no fwserve container in the render")
    check_selectors(c, objects, by_kind)
    return c


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--fwserve", required=True)
    parser.add_argument("--kubectl", default=shutil.which("kubectl"))
    parser.add_argument("--yamllint", default=shutil.which("yamllint"))
    parser.add_argument("overlays", nargs="+")
    args = parser.parse_args()
    if not args.kubectl or not os.path.exists(args.kubectl):
        print("k8s_check: SKIPPED: kubectl is not installed (it renders the kustomizations;"
              " Debian's kubernetes-client suffices: scripts/install-deps.sh)")
        sys.exit(SKIP_CODE)
    print("k8s_check: %s (%s)" % (kubectl_version(args.kubectl), args.kubectl))
    problems, checks = [], 0
    k8s = os.path.join(args.repo, "deploy", "k8s")
    config = os.path.join(k8s, ".yamllint")
    if not args.yamllint:
        problems.append("yamllint is not installed (scripts/install-deps.sh installs it)")
    else:
        lint = subprocess.run([args.yamllint, "--strict", "-c", config, k8s,
                               os.path.join(args.repo, "deploy", "compose.yaml")],
                              capture_output=True, text=True)
        checks += 1
        if lint.returncode != 0:
            problems.append("yamllint of deploy/k8s and deploy/compose.yaml:\n" + lint.stdout
                            + lint.stderr)
    # The renders are kustomize's formatting, not ours: a Secret's base64 value may be one
    # long line (kustomize v2.0.3).
    render_config = ("{extends: %s, rules: {line-length: {max: 110, "
                     "allow-non-breakable-inline-mappings: true}}}" % json.dumps(config))
    warnings = []
    flags_known = known_flags(args.fwserve)
    if len(flags_known) < 10:
        problems.append("could not read the flags of %s" % args.fwserve)
    for overlay in args.overlays:
        path = os.path.join(k8s, "overlays", overlay)
        render = subprocess.run([args.kubectl, "kustomize", path], capture_output=True,
                                text=True)
        checks += 1
        if render.returncode != 0:
            problems.append("kubectl kustomize %s: %s" % (path, render.stderr))
            continue
        # Newer kustomize warns that `bases:` and patchesJson6902 are deprecated (kept
        # for v2.0.3): shown once, not failures.
        for line in render.stderr.splitlines():
            if line.strip() and line.strip() not in warnings:
                warnings.append(line.strip())
        if args.yamllint:
            lint = subprocess.run([args.yamllint, "--strict", "-d", render_config, "-"],
                                  input=render.stdout, capture_output=True, text=True)
            checks += 1
            if lint.returncode != 0:
                problems.append("yamllint of the %s render:\n%s" % (overlay, lint.stdout))
        result = check_overlay(path, render.stdout, flags_known)
        checks += result.checks
        problems += result.problems
        print("%s: %d objects checked" % (overlay, len([o for o in yaml.safe_load_all(
            render.stdout) if o])))
    for warning in warnings:
        print("kubectl kustomize warned (expected from kustomize v4+; the syntax is kept "
              "for v2.0.3, do not `kustomize edit fix`): " + warning.lstrip("# "))
    for problem in problems:
        print("FAIL " + problem)
    print("%d passed, %d failed" % (checks - len(problems), len(problems)))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
