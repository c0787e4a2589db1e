"""The Helm chart (helm/presto-sd) and the service image's Dockerfile, checked offline.

helm_python runs Helm's own Go code (lint, values-schema validation, render) with no helm
binary and no cluster. Every rendered object is validated, strictly (unknown fields fail),
against the Kubernetes OpenAPI schemas of KUBE_VERSIONS shipped in kubernetes-validate.
Custom resources (RayCluster, ServiceMonitor) have no schema there: their embedded pod
templates are validated as core PodTemplates, and the rest is held by the assertions here.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "presto-sd"
# the chart's kubeVersion floor (native gRPC probes are GA from 1.27) and the newest schema
# kubernetes-validate ships
KUBE_VERSIONS = ("1.27.0", "1.37.0")
CUSTOM_RESOURCES = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
# values files: the defaults, and the chart-testing files in ci/
VALUES = {"default": {}} | {
    p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text())
    for p in sorted(CHART.glob("ci/*.yaml"))
}
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
RELEASE, NAMESPACE = "demo", "serving"
FULL = f"{RELEASE}-presto-sd"

helm.disable_logging()  # Helm logs each fail() of the negative tests at INFO


def render(values: dict, chart: Path = CHART, release: str = RELEASE) -> list[dict]:
    """The objects an install of ``chart`` with ``values`` would create (NOTES.txt left out)."""
    with helm.Chart.load(chart) as c:
        files = c.render(values, name=release, namespace=NAMESPACE, is_install=True)
    return [doc for name, text in files.items() if not name.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in VALUES.items()}


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def pod_specs(objs: list[dict]) -> dict[str, dict]:
    """Every pod spec in the release, by owner: workloads, the Ray groups, the test Pod."""
    specs = {}
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("StatefulSet", "Deployment"):
            specs[name] = o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            specs[name] = o["spec"]
        elif o["kind"] == "RayCluster":
            specs[f"{name}/head"] = o["spec"]["headGroupSpec"]["template"]["spec"]
            for g in o["spec"]["workerGroupSpecs"]:
                specs[f"{name}/{g['groupName']}"] = g["template"]["spec"]
    return specs


def serving_container(objs: list[dict], component: str) -> dict:
    """The drafter / verifier / orchestrator container (the orchestrator on the Ray head or not)."""
    for name, spec in pod_specs(objs).items():
        if name in (f"StatefulSet/{FULL}-{component}", f"Deployment/{FULL}-{component}") or (
            component == "orchestrator" and name.endswith("/head")
        ):
            return spec["containers"][0]
    raise AssertionError(f"no {component} pod")


def command_line(container: dict) -> str:
    return " ".join(container.get("command", []) + container.get("args", []))


# -- Helm: lint, schema, render ------------------------------------------------------------
@pytest.mark.parametrize("name", VALUES)
def test_chart_lints_clean(name):
    report = helm.lint(CHART, VALUES[name], strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 = info ("icon is recommended")
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("name", VALUES)
def test_every_manifest_validates_against_kubernetes(rendered, name):
    checked = 0
    for obj in rendered[name]:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_RESOURCES:
            # no schema for CRDs: validate the pod templates they embed as core objects
            docs = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t}
                    for t in embedded_pod_templates(obj)]
        else:
            docs = [obj]
        for doc in docs:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
    assert checked >= 2 * 8


def embedded_pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] != "RayCluster":
        return []
    spec = obj["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_each_values_file_renders_what_it_asks_for(rendered):
    kinds = {name: {(o["kind"], o["metadata"]["name"]) for o in objs} for name, objs in rendered.items()}
    core = {("StatefulSet", f"{FULL}-drafter"), ("StatefulSet", f"{FULL}-verifier"),
            ("Service", f"{FULL}-orchestrator"), ("ConfigMap", f"{FULL}-engine"),
            ("Pod", f"{FULL}-test-generate")}
    for name in VALUES:
        assert core <= kinds[name], name
    assert ("RayCluster", FULL) in kinds["default"]
    assert ("Deployment", f"{FULL}-orchestrator") in kinds["kuberay-off"]
    assert not any(k == "RayCluster" for k, _ in kinds["kuberay-off"])
    assert ("PersistentVolumeClaim", f"{FULL}-models") in kinds["kuberay-off"]
    tls = kinds["tls-auth-monitoring"]
    assert {("ServiceMonitor", FULL), ("Secret", f"{FULL}-auth"), ("ConfigMap", f"{FULL}-probe")} <= tls


# -- what lands in the pods ------------------------------------------------------------------
def gpu_resources(container: dict) -> dict:
    res = container.get("resources", {})
    return {k: v for part in ("limits", "requests") for k, v in res.get(part, {}).items()
            if k not in ("cpu", "memory", "ephemeral-storage")}


def test_gpu_resource_name_and_count_land_where_set(rendered):
    default = rendered["default"]
    for component in ("drafter", "verifier"):
        c = serving_container(default, component)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gpu_resources(serving_container(default, "orchestrator")) == {}
    tls = rendered["tls-auth-monitoring"]
    assert gpu_resources(serving_container(tls, "drafter")) == {"nvidia.com/mig-1g.10gb": 1}
    assert gpu_resources(serving_container(tls, "verifier")) == {"nvidia.com/gpu": 2}
    # the GPU is merged into the resources, not put in their place
    assert serving_container(tls, "verifier")["resources"]["limits"]["memory"] == "32Gi"
    for spec in pod_specs(rendered["cpu-only"]).values():
        for c in spec["containers"] + spec.get("initContainers", []):
            assert gpu_resources(c) == {}, c["name"]
        assert "tolerations" not in spec


@pytest.mark.parametrize("component", ["drafter", "verifier", "orchestrator"])
def test_probes_use_grpc_health_on_the_serving_port(rendered, component):
    port = DEFAULTS[component]["port"]
    c = serving_container(rendered["default"], component)
    assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe  # grpc.health.v1, service "" (the whole server)
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 10 * 60  # minutes of model load
    # with TLS, native probes cannot speak it: the exec check over TLS, same port
    tls = serving_container(rendered["tls-auth-monitoring"], component)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = tls[probe]["exec"]["command"]
        assert cmd[:2] == ["python", "/etc/presto-sd/probe/health_probe.py"]
        assert cmd[cmd.index("--port") + 1] == str(port) and "--client-cert" in cmd


@pytest.mark.parametrize("name", VALUES)
def test_every_container_runs_locked_down(rendered, name):
    for owner, spec in pod_specs(rendered[name]).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["runAsUser"] == 10001, owner
        assert spec["automountServiceAccountToken"] is False, owner
        mounted = {v["name"] for v in spec["volumes"]}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            paths = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "/tmp" in paths, f"{owner}/{c['name']}: no writable /tmp"
            assert set(paths.values()) <= mounted


def test_model_volume_and_fetch_init_container(rendered):
    spec = pod_specs(rendered["default"])[f"StatefulSet/{FULL}-verifier"]
    init = spec["initContainers"][0]
    assert init["command"] == ["flock", "/models/.fetch.lock", "presto-sd", "models", "fetch"]
    assert {"name": "PRESTO_SD_CACHE", "value": "/models"} in init["env"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]  # writable for the fetch
    serving_mount = {"name": "models", "mountPath": "/models", "readOnly": True}
    assert serving_mount in spec["containers"][0]["volumeMounts"]
    assert {"name": "models", "emptyDir": {"sizeLimit": "10Gi"}} in spec["volumes"]
    off = pod_specs(rendered["kuberay-off"])[f"StatefulSet/{FULL}-drafter"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": f"{FULL}-models"}} in off["volumes"]
    tls = pod_specs(rendered["tls-auth-monitoring"])[f"StatefulSet/{FULL}-drafter"]
    assert "initContainers" not in tls
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "presto-sd-weights"}} in tls["volumes"]
    args = serving_container(rendered["tls-auth-monitoring"], "drafter")["args"]
    assert args[args.index("--target") + 1] == "/models/Qwen3-8B"


# -- wiring between the components -----------------------------------------------------------
def test_orchestrator_addresses_every_replica_through_headless_services(rendered):
    objs = rendered["tls-auth-monitoring"]  # 3 drafters, 2 verifiers
    cmd = command_line(serving_container(objs, "orchestrator"))
    for component, n, port in (("drafter", 3, 50051), ("verifier", 2, 50052)):
        svc = find(objs, "Service", f"{FULL}-{component}")
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["ports"][0]["port"] == port
        sts = find(objs, "StatefulSet", f"{FULL}-{component}")
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and sts["spec"]["replicas"] == n
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        addrs = re.search(rf"--{component}-addr (\S+)", cmd).group(1).split(",")
        assert addrs == [f"{FULL}-{component}-{i}.{FULL}-{component}.{NAMESPACE}.svc.cluster.local:{port}"
                         for i in range(n)]
    assert "--ray-address auto" in cmd


def test_generate_service_points_at_the_orchestrator_in_both_modes(rendered):
    for name in ("default", "kuberay-off"):
        objs = rendered[name]
        svc = find(objs, "Service", f"{FULL}-orchestrator")
        cmd = command_line(serving_container(objs, "orchestrator"))
        assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50050, "targetPort": "grpc",
                                         "protocol": "TCP", "appProtocol": "grpc"}]
        if name == "default":
            ray = find(objs, "RayCluster", FULL)
            assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
            labels = ray["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
            workers = ray["spec"]["workerGroupSpecs"]
            assert len(workers) == 1 and workers[0]["replicas"] == 1
            worker_labels = workers[0]["template"]["metadata"]["labels"]
            assert not svc["spec"]["selector"].items() <= worker_labels.items()  # the head only
            assert "${KUBERAY_GEN_RAY_START_CMD/--block/}" in cmd  # KubeRay's ray start, not blocking
        else:
            deployment = find(objs, "Deployment", f"{FULL}-orchestrator")
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert "ray start --head" in cmd  # a one-node Ray in the pod
        assert svc["spec"]["selector"].items() <= labels.items()
        assert cmd.count("exec presto-sd serve orchestrator") == 1


def test_engine_configmap_feeds_every_flag(rendered):
    objs = rendered["tls-auth-monitoring"]
    data = find(objs, "ConfigMap", f"{FULL}-engine")["data"]
    assert data["PRESTO_SD_METHOD"] == "presto-best-first" and data["PRESTO_SD_DEPTH"] == "12"
    assert data["PRESTO_SD_LAMBDA"] == "0.5,0.4,0.3" and data["PRESTO_SD_BUDGET"] == "64"
    assert "PRESTO_SD_DEPTH" not in find(rendered["default"], "ConfigMap", f"{FULL}-engine")["data"]
    cmd = command_line(serving_container(objs, "orchestrator"))
    for flag, var in (("--method", "METHOD"), ("--budget", "BUDGET"), ("--max-new-tokens", "MAX_NEW_TOKENS")):
        assert f'{flag} "$PRESTO_SD_{var}"' in cmd
    for flag, var in (("--depth", "DEPTH"), ("--lambda", "LAMBDA")):  # only when set
        assert f'${{PRESTO_SD_{var}:+{flag} "$PRESTO_SD_{var}"}}' in cmd
    for component in ("drafter", "verifier"):
        c = serving_container(objs, component)
        assert c["envFrom"] == [{"configMapRef": {"name": f"{FULL}-engine"}}]
        used = re.findall(r"\$\((\w+)\)", " ".join(c["args"]))
        assert used and set(used) <= set(data), "a $(VAR) with no ConfigMap key stays literal"
        assert c["args"][c["args"].index("--max-sessions") + 1] == "$(PRESTO_SD_MAX_SESSIONS)"


def test_tls_and_token_are_wired_to_the_cli_flags(rendered):
    objs = rendered["tls-auth-monitoring"]
    for component in ("drafter", "verifier"):
        c = serving_container(objs, component)
        args = dict(zip(c["args"][::2], c["args"][1::2], strict=False))
        assert args["--tls-cert"] == "/etc/presto-sd/tls/tls.crt"
        assert args["--tls-key"] == "/etc/presto-sd/tls/tls.key"
        assert args["--tls-client-ca"] == "/etc/presto-sd/tls/ca.crt"
        assert "--auth-token-file" in c["args"] and "/etc/presto-sd/auth/token" in c["args"]
    for owner, spec in pod_specs(objs).items():
        volumes = {v["name"]: v for v in spec["volumes"]}
        if owner.endswith("/workers"):
            continue  # Ray workers hold no gRPC endpoint of ours
        assert volumes["tls"]["secret"]["secretName"] == "presto-sd-tls", owner
        assert volumes["auth"]["secret"]["secretName"] == f"{FULL}-auth", owner
    # the orchestrator serves TLS to its callers and is a TLS client of the engines
    orch = command_line(serving_container(objs, "orchestrator"))
    for flag in ("--tls-cert", "--tls-client-ca", "--auth-token-file", "--engine-tls-ca",
                 "--engine-tls-client-cert", "--engine-tls-client-key", "--engine-auth-token-file"):
        assert orch.count(f"'{flag}'") == 1, flag
    test_pod = command_line(find(objs, "Pod", f"{FULL}-test-generate")["spec"]["containers"][0])
    assert "'--tls-ca' '/etc/presto-sd/tls/ca.crt'" in test_pod and "'--auth-token-file'" in test_pod
    secret = find(objs, "Secret", f"{FULL}-auth")
    assert len(secret["data"]["token"]) >= 48  # a random token, base64
    for name in VALUES:
        if name != "tls-auth-monitoring":
            assert "--tls-cert" not in " ".join(serving_container(rendered[name], "verifier")["args"])


def test_helm_test_hook_calls_generate_and_checks_the_answer(rendered):
    pod = find(rendered["default"], "Pod", f"{FULL}-test-generate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    cmd = command_line(pod["spec"]["containers"][0])
    addr = f"{FULL}-orchestrator.{NAMESPACE}.svc.cluster.local:50050"
    assert "presto-sd generate 'What is 2+2?'" in cmd and f"--orchestrator-addr {addr}" in cmd
    assert "--json" in cmd and "--max-new-tokens 16" in cmd
    assert 'answer["new_tokens"] > 0' in cmd and "json.load" in cmd


def test_metrics_service_monitor_scrapes_every_ray_node(rendered):
    objs = rendered["tls-auth-monitoring"]
    monitor = find(objs, "ServiceMonitor", FULL)
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    svc = find(objs, "Service", f"{FULL}-ray-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    ray = find(objs, "RayCluster", FULL)
    for group in [ray["spec"]["headGroupSpec"]] + ray["spec"]["workerGroupSpecs"]:
        assert svc["spec"]["selector"].items() <= group["template"]["metadata"]["labels"].items()
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        ports = group["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in ports
    assert not any(o["kind"] == "ServiceMonitor" for o in rendered["default"])


def test_grafana_dashboard_configmap_from_the_chart_dashboards(tmp_path):
    values = {"monitoring": {"grafanaDashboard": {"enabled": True, "folder": "presto-sd"}}}
    shipped = sorted(p.name for p in CHART.glob("dashboards/*.json"))
    if not shipped:  # the metrics work ships the real one: until then, nothing is rendered
        assert not [o for o in render(values) if o["metadata"]["name"] == f"{FULL}-dashboards"]
    # a copy of the chart with a minimal dashboard, next to whatever the chart ships
    chart = tmp_path / "presto-sd"
    shutil.copytree(CHART, chart)
    (chart / "dashboards").mkdir(exist_ok=True)
    (chart / "dashboards" / "zz-minimal.json").write_text(json.dumps({"title": "minimal", "panels": []}))
    cm = find(render(values, chart), "ConfigMap", f"{FULL}-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "presto-sd"
    assert sorted(cm["data"]) == sorted(shipped + ["zz-minimal.json"])
    for text in cm["data"].values():
        json.loads(text)
    kubernetes_validate.validate(cm, KUBE_VERSIONS[-1], strict=True)
    off_by_default = render({}, chart)
    assert not [o for o in off_by_default if o["metadata"]["name"] == f"{FULL}-dashboards"]


def test_names_fit_kubernetes_limits_with_the_longest_release_name():
    release = "r" * 53  # Helm's own limit on release names
    objs = render(VALUES["tls-auth-monitoring"], release=release)
    for o in objs:
        name = o["metadata"]["name"]
        assert len(name) <= 63 - (3 if o["kind"] == "StatefulSet" else 0), name  # room for "-NN"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


# -- the command lines parse with presto-sd's own CLI ------------------------------------------
@pytest.fixture(scope="module")
def presto_cli():
    from presto_sd.app.cli import build_parser

    return build_parser()


def parse(parser, argv: list[str]):
    """Parse ``argv`` as the pod would run it; a flag the CLI lacks fails with its message.

    Never a skip: the chart and the CLI ship together, so a command line the CLI refuses is
    a regression of one or the other (this once skipped, and hid exactly that).
    """
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"presto-sd {' '.join(argv)}\n{err.getvalue()}") from None


def orchestrator_argv(container: dict, env: dict[str, str]) -> list[str]:
    """The argv the orchestrator's start script execs, expanded by bash itself."""
    import subprocess

    if shutil.which("bash") is None:  # the one thing this needs that may genuinely be absent
        pytest.skip("no bash here to expand the orchestrator's start script")
    line = next(x for x in container["args"][0].splitlines() if x.startswith("exec presto-sd "))
    line = line.replace("exec presto-sd", "printf '%s\\0'", 1)
    out = subprocess.run(["bash", "-c", line], env=env, capture_output=True, check=True).stdout
    return out.decode().split("\0")[:-1]


@pytest.mark.parametrize("name", VALUES)
def test_engine_command_lines_parse(rendered, presto_cli, name):
    env = find(rendered[name], "ConfigMap", f"{FULL}-engine")["data"]
    for component in ("drafter", "verifier"):
        c = serving_container(rendered[name], component)
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
        args = parse(presto_cli, argv)
        assert (args.service, args.host, args.port) == (component, "0.0.0.0", c["ports"][0]["containerPort"])
        assert args.max_sessions == DEFAULTS["limits"]["maxSessions"]


@pytest.mark.parametrize("name", VALUES)
def test_orchestrator_command_line_parses(rendered, presto_cli, name):
    env = find(rendered[name], "ConfigMap", f"{FULL}-engine")["data"]
    argv = orchestrator_argv(serving_container(rendered[name], "orchestrator"), env)
    args = parse(presto_cli, argv)
    assert args.method == VALUES[name].get("engine", {}).get("method", DEFAULTS["engine"]["method"])
    assert args.ray_address == "auto" and args.port == DEFAULTS["orchestrator"]["port"]


def test_test_hook_command_line_parses(rendered, presto_cli):
    c = find(rendered["tls-auth-monitoring"], "Pod", f"{FULL}-test-generate")["spec"]["containers"][0]
    line = c["args"][0].split("presto-sd ", 1)[1].split(" > ")[0].replace("\\\n", " ")
    import shlex

    args = parse(presto_cli, shlex.split(line))
    assert args.json and args.max_new_tokens == 16 and args.tls_ca == "/etc/presto-sd/tls/ca.crt"


def test_schema_methods_are_the_cli_methods():
    from presto_sd.method.methods import METHOD_NAMES as METHOD_CHOICES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["engine"]["properties"]["method"]["enum"] == list(METHOD_CHOICES)


# -- bad values fail the install with a message that names the field -------------------------
@pytest.mark.parametrize("values, message", [
    ({"verifier": {"gpu": {"resourceName": "gpu", "count": 1}}}, "at '/verifier/gpu/resourceName'"),
    ({"drafter": {"gpu": {"resourceName": "nvidia.com/gpu", "count": -1}}}, "at '/drafter/gpu/count'"),
    ({"engine": {"method": "fastest"}}, "at '/engine/method': value must be one of"),
    ({"engine": {"budget": 5000}}, "at '/engine/budget'"),
    ({"engine": {"lambda": "0.5;0.4"}}, "at '/engine/lambda'"),
    ({"verifier": {"gpus": 2}}, "at '/verifier': additional properties 'gpus' not allowed"),
    ({"tls": {"enabled": True}}, "at '/tls/secretName'"),
    ({"modelStorage": {"type": "existingClaim"}}, "at '/modelStorage/existingClaim'"),
    ({"modelStorage": {"type": "nfs"}}, "at '/modelStorage/type'"),
    ({"orchestrator": {"kuberay": {"headRayStartParams": {"num-cpus": 0}}}},
     "at '/orchestrator/kuberay/headRayStartParams/num-cpus'"),
])
def test_values_that_break_the_schema_are_rejected(values, message):
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)
    with helm.Chart.load(CHART) as c:
        with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
            c.validate_schema(values)


@pytest.mark.parametrize("values, message", [
    ({"image": {"tag": "latest"}}, "image.tag: pin a version"),
    ({"modelStorage": {"fetch": {"enabled": False}}}, "an emptyDir volume starts empty"),
    ({"verifier": {"terminationGracePeriodSeconds": 15}},
     "verifier.terminationGracePeriodSeconds (15) must exceed"),
    ({"orchestrator": {"kuberay": {"workers": {"replicas": 9}}}}, "minReplicas <= replicas <= maxReplicas"),
])
def test_inconsistent_values_are_rejected(values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


# -- values.yaml is documented field by field, and the schema knows every field ------------
FREE_FORM = {"podSecurityContext", "securityContext", "resources", "startup", "readiness", "liveness"}


def values_keys() -> list[tuple[list[str], bool]]:
    """(path, has a comment right above) of every key line in values.yaml (not in lists)."""
    keys, stack, prev, list_indent = [], [], "", None
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        item = re.match(r"^( *)- ", line)
        if item:
            list_indent = len(item.group(1))
        elif m and (list_indent is None or len(m.group(1)) <= list_indent):
            list_indent = None
            depth = len(m.group(1)) // 2
            stack = stack[:depth] + [m.group(2)]
            keys.append((list(stack), prev.lstrip().startswith("#")))
        if line.strip():
            prev = line
    return keys


def test_values_are_documented_field_by_field():
    undocumented = [".".join(path) for path, commented in values_keys()
                    if not commented and not FREE_FORM & set(path[:-1])]
    assert not undocumented, undocumented


def test_schema_covers_every_values_field():
    schema = json.loads((CHART / "values.schema.json").read_text())

    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    for path, _ in values_keys():
        node = schema
        for key in path:
            node = resolve(node)
            if node.get("type") == "object" and "properties" not in node:
                break  # free-form Kubernetes structure (affinity, securityContext, ...)
            props = node.get("properties", {})
            assert key in props or isinstance(node.get("additionalProperties"), dict), ".".join(path)
            node = props.get(key, node.get("additionalProperties"))


# -- the Dockerfile (no Docker engine here: read and checked) --------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")))
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


def test_dockerfile_builds_a_pinned_non_root_presto_sd_image():
    steps = dockerfile()
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    froms = [a.split()[0] for k, a in steps if k == "FROM"]
    for image in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert ":" in image and not image.endswith(":latest"), f"unpinned base {image}"
    final = steps[max(i for i, (k, _) in enumerate(steps) if k == "FROM"):]
    users = [a for k, a in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0] == str(DEFAULTS["podSecurityContext"]["runAsUser"])
    assert ("ENTRYPOINT", '["presto-sd"]') in final
    assert ("VOLUME", '["/models"]') in final
    assert any("PRESTO_SD_CACHE=/models" in a for k, a in final if k == "ENV")


def test_dockerfile_pins_torch_and_ray_to_what_the_project_and_chart_use():
    steps = dockerfile()
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    runs = " ".join(a for k, a in steps if k == "RUN")
    # torch from the chosen variant's index, then held there by a constraint for every later install
    assert '"torch==${TORCH_VERSION}+${TORCH_VARIANT}"' in runs and "whl/${TORCH_VARIANT}" in runs
    assert "--constraint /opt/presto-sd/constraints.txt" in runs
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in setup  # the version the project tests
    assert args["RAY_VERSION"] == DEFAULTS["orchestrator"]["kuberay"]["rayVersion"]
    assert '"ray[default]==${RAY_VERSION}"' in runs


def test_dockerfile_copies_every_package_and_dockerignore_lets_them_in():
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    packages = [p.strip(' "*') for p in include.split(",")]
    copied = {a.split()[0] for k, a in dockerfile() if k == "COPY" and not a.startswith("--from")}
    allowed = {line.lstrip("!").rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for package in packages:
        assert package in copied and package in allowed and (ROOT / package).is_dir(), package
    assert {"pyproject.toml", "README.md"} <= allowed


# -- the TLS health probe (files/health_probe.py) against a real gRPC server -----------------
@pytest.fixture
def tls_health_server(tmp_path):
    """A grpc.health.v1 server on loopback with TLS; yields (port, health servicer, TLS dirs)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from tests.rpc_util import make_pki

    pki = {k: Path(v) for k, v in make_pki(tmp_path).items()}
    dirs = {}
    for label, cert in (("server-cert", "server"), ("client-cert", "client")):
        d = dirs[label] = tmp_path / label  # laid out as the chart mounts the TLS Secret
        d.mkdir()
        shutil.copy(pki["ca.pem"], d / "ca.crt")
        shutil.copy(pki[f"{cert}.pem"], d / "tls.crt")
        shutil.copy(pki[f"{cert}.key"], d / "tls.key")
    servers = []

    def start(mutual: bool):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        key_pair = (pki["server.key"].read_bytes(), pki["server.pem"].read_bytes())
        ca = pki["ca.pem"].read_bytes()
        creds = grpc.ssl_server_credentials([key_pair], ca, require_client_auth=mutual)
        port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        servers.append(server)
        return port, servicer

    yield start, dirs
    for server in servers:
        server.stop(0)


def probe(port: int, tls_dir: Path, server_name: str = "localhost", *extra: str) -> int:
    import subprocess
    import sys

    cmd = [sys.executable, str(CHART / "files" / "health_probe.py"), "--port", str(port),
           "--tls-dir", str(tls_dir), "--server-name", server_name, "--timeout", "3", *extra]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode


def test_tls_probe_reports_serving_only_over_a_verified_connection(tls_health_server):
    from grpc_health.v1 import health_pb2

    start, dirs = tls_health_server
    port, servicer = start(mutual=False)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(port, dirs["server-cert"]) == 0
    assert probe(port, dirs["server-cert"], "{hostname}.elsewhere.svc") == 1  # the name is checked
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # loading, or draining
    assert probe(port, dirs["server-cert"]) == 1
    mutual_port, mutual = start(mutual=True)
    mutual.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(mutual_port, dirs["client-cert"]) == 1  # no client certificate presented
    assert probe(mutual_port, dirs["client-cert"], "localhost", "--client-cert") == 0
