"""deploy/kubernetes, validated offline: every object of every kustomization (base and overlays,
composed by :mod:`tests.deploy.kustomize`) against the Kubernetes schemas (``kubernetes-validate``,
strict) and the gateway CRD schemas (``tests/deploy/schemas``); the endpoint picker configuration
against its schema; and the wiring between the objects (pool selector and ports, the picker's
metric names against the names Helios exports, ``helios run`` arguments, probes, shutdown timing,
the KV-event port). Negative cases prove each check fails on a broken manifest.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helios_core.cli import build_parser
from helios_core.server.kv_events import binds, parse_kv_events_config
from helios_core.server.metrics import HELIOS_LOAD_NAMES, VLLM_LOAD_NAMES
from tests.deploy.kustomize import KustomizeError, Manifest, build, object_id

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUSTOMIZATIONS = {
    "base": KUBERNETES / "base",
    "vllm-metrics": KUBERNETES / "overlays" / "vllm-metrics",
    "precise-prefix": KUBERNETES / "overlays" / "precise-prefix",
}
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
"""The oldest Kubernetes the manifests support (native preStop sleep, gRPC probes) and the newest schema bundled."""

CORE_KINDS = {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding"}
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
OBJECT_META_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": DNS_SUBDOMAIN},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
SHUTDOWN_MARGIN_SECONDS = 5
"""terminationGracePeriodSeconds = preStop sleep + --shutdown-timeout + this (the last events and the exit)."""


# ---------------------------------------------------------------------------- validation


def strict(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever it lists properties, as an API server's
    strict field validation does (objects that preserve unknown fields are left open)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in result
        and "additionalProperties" not in result
        and not result.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


def _load_crd_schema(filename: str) -> dict[str, Any]:
    schema = strict(json.loads((SCHEMAS / filename).read_text(encoding="utf-8")))
    schema["properties"]["metadata"] = OBJECT_META_SCHEMA
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return schema


CRD_VALIDATORS = {key: jsonschema.Draft7Validator(_load_crd_schema(filename)) for key, filename in CRD_SCHEMAS.items()}
EPP_CONFIG_VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((SCHEMAS / "endpointpickerconfig-v1alpha1.json").read_text(encoding="utf-8"))
)


def _where(path: Any) -> str:
    return "/".join(str(part) for part in path)


def _inferencepool_rules(manifest: Manifest) -> list[str]:
    """The CEL rules (x-kubernetes-validations) of the InferencePool CRD, which JSON Schema cannot express."""
    spec = manifest.get("spec", {})
    problems = []
    reference = spec.get("endpointPickerRef", {})
    if reference.get("kind", "Service") == "Service" and "port" not in reference:
        problems.append("spec/endpointPickerRef: port is required when kind is 'Service' or unspecified")
    numbers = [port.get("number") for port in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        problems.append("spec/targetPorts: port number must be unique")
    return problems


def problems(manifest: Manifest, version: str) -> list[str]:
    """Why the API server of Kubernetes ``version`` would refuse ``manifest`` (empty: valid)."""
    api_version, kind, name = object_id(manifest)
    label = f"{kind}/{name}"
    if kind in CORE_KINDS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            return [f"{label}: {_where(error.path)}: {error.message}"]
        return []
    validator = CRD_VALIDATORS.get((api_version, kind))
    if validator is None:
        return [f"{label}: no schema for {api_version} {kind}"]
    found = [
        f"{label}: {_where(error.path)}: {error.message}"
        for error in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.path)))
    ]
    if kind == "InferencePool":
        found.extend(f"{label}: {problem}" for problem in _inferencepool_rules(manifest))
    return found


def epp_configs(objects: list[Manifest]) -> dict[str, dict[str, Any]]:
    """The EndpointPickerConfig files in the ConfigMaps, by ``configmap-name/key``."""
    configs = {}
    for manifest in objects:
        if manifest["kind"] != "ConfigMap":
            continue
        for key, text in manifest.get("data", {}).items():
            document = yaml.safe_load(text)
            if isinstance(document, dict) and document.get("kind") == "EndpointPickerConfig":
                configs[f"{manifest['metadata']['name']}/{key}"] = document
    return configs


def epp_config_problems(config: dict[str, Any]) -> list[str]:
    """Schema errors of one EndpointPickerConfig, and references to plugins it does not declare."""
    found = sorted(f"{_where(error.path)}: {error.message}" for error in EPP_CONFIG_VALIDATOR.iter_errors(config))
    if found:
        return found
    declared = {plugin.get("name", plugin["type"]) for plugin in config["plugins"]}
    references = [entry["pluginRef"] for profile in config["schedulingProfiles"] for entry in profile["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        references.append(source["pluginRef"])
        references.extend(extractor["pluginRef"] for extractor in source.get("extractors", []))
    if "saturationDetector" in config:
        references.append(config["saturationDetector"]["pluginRef"])
    return [
        f"pluginRef {reference!r} names no declared plugin" for reference in references if reference not in declared
    ]


def engine_configs(config: dict[str, Any]) -> dict[str, dict[str, str]]:
    for plugin in config["plugins"]:
        if plugin["type"] == "core-metrics-extractor":
            return {entry["name"]: entry for entry in plugin.get("parameters", {}).get("engineConfigs", [])}
    return {}


def metric_mapping_problems(config: dict[str, Any]) -> list[str]:
    """The picker's Helios and vLLM mappings must name exactly the gauges the server exports."""
    expected = {"helios": HELIOS_LOAD_NAMES, "vllm": VLLM_LOAD_NAMES}
    found = []
    configs = engine_configs(config)
    for engine, names in expected.items():
        entry = configs.get(engine)
        if entry is None:
            found.append(f"no engineConfigs entry {engine!r}")
            continue
        mapped = (entry.get("queuedRequestsSpec"), entry.get("runningRequestsSpec"), entry.get("kvUsageSpec"),
                  entry.get("cacheInfoSpec"))  # fmt: skip
        if mapped != tuple(names):
            found.append(f"engine {engine!r} maps {mapped}, the server exports {tuple(names)}")
        if entry.get("loraSpec") != "":
            found.append(f"engine {engine!r}: loraSpec must be empty (Helios exports no LoRA metric)")
    return found


def by_kind(objects: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {manifest["metadata"]["name"]: manifest for manifest in objects if manifest["kind"] == kind}


def container(deployment: Manifest, name: str) -> dict[str, Any]:
    for candidate in deployment["spec"]["template"]["spec"]["containers"]:
        if candidate["name"] == name:
            return candidate  # type: ignore[no-any-return]
    raise AssertionError(f"{deployment['metadata']['name']} has no container {name!r}")


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an argument list (None: absent)."""
    for index, argument in enumerate(args):
        if argument == name:
            return args[index + 1]
        if argument.startswith(name + "="):
            return argument.split("=", 1)[1]
    return None


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def composed(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[Manifest]]]:
    yield request.param, build(KUSTOMIZATIONS[request.param])


# ---------------------------------------------------------------------------- every object is valid


def test_every_manifest_file_belongs_to_a_kustomization() -> None:
    referenced: set[Path] = set()
    for path in KUBERNETES.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(path.read_text(encoding="utf-8")).get("resources", []):
            referenced.add((path.parent / resource).resolve())
    files = {path.resolve() for path in KUBERNETES.rglob("*.yaml") if path.name != "kustomization.yaml"}
    assert sorted(files - referenced) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid(composed: tuple[str, list[Manifest]], version: str) -> None:
    _, objects = composed
    assert len(objects) >= 11
    assert [problem for manifest in objects for problem in problems(manifest, version)] == []


def test_the_composition_equals_kubectl_kustomize(composed: tuple[str, list[Manifest]]) -> None:
    """The Python composition is the real one (checked where kubectl is installed)."""
    overlay, objects = composed
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATIONS[overlay])], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"kubectl kustomize failed: {result.stderr.strip()[:200]}")
    theirs = [document for document in yaml.safe_load_all(result.stdout) if document]
    assert sorted(map(json.dumps, map(_sorted, objects))) == sorted(map(json.dumps, map(_sorted, theirs)))


def _sorted(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _sorted(node[key]) for key in sorted(node)}
    if isinstance(node, list):
        return [_sorted(item) for item in node]
    return node


def test_every_endpoint_picker_config_is_valid(composed: tuple[str, list[Manifest]]) -> None:
    _, objects = composed
    configs = epp_configs(objects)
    assert configs, "no EndpointPickerConfig found"
    assert {name: epp_config_problems(config) for name, config in configs.items()} == {name: [] for name in configs}
    assert {name: metric_mapping_problems(config) for name, config in configs.items()} == {name: [] for name in configs}


# ---------------------------------------------------------------------------- wiring between objects


def _used_epp_config(objects: list[Manifest]) -> dict[str, Any]:
    epp = by_kind(objects, "Deployment")["helios-epp"]
    path = option(container(epp, "epp")["args"], "--config-file")
    assert path is not None
    mount = next(m for m in container(epp, "epp")["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    key = path[len(mount["mountPath"]) + 1 :]
    assert key in config_map["data"], f"{config_map['metadata']['name']} has no key {key!r}"
    return yaml.safe_load(config_map["data"][key])  # type: ignore[no-any-return]


def test_the_pool_selects_the_helios_pods_and_their_port(composed: tuple[str, list[Manifest]]) -> None:
    _, objects = composed
    helios = by_kind(objects, "Deployment")["helios"]
    pool = by_kind(objects, "InferencePool")["helios"]
    pod_labels = helios["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {port["name"]: port["containerPort"] for port in container(helios, "helios")["ports"]}
    assert [port["number"] for port in pool["spec"]["targetPorts"]] == [ports["http"]]
    assert option(container(helios, "helios")["args"], "--port") == str(ports["http"])
    # the picker's Service: name and port of endpointPickerRef, selecting the picker's pods
    reference = pool["spec"]["endpointPickerRef"]
    service = by_kind(objects, "Service")[reference["name"]]
    assert reference["port"]["number"] in [port["port"] for port in service["spec"]["ports"]]
    epp = by_kind(objects, "Deployment")["helios-epp"]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert option(container(epp, "epp")["args"], "--pool-name") == pool["metadata"]["name"]
    # the route sends everything to the pool
    route = by_kind(objects, "HTTPRoute")["helios"]
    backends = [backend for rule in route["spec"]["rules"] for backend in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "helios"}]


def test_the_pods_engine_label_picks_the_metric_names_the_server_exports(
    composed: tuple[str, list[Manifest]],
) -> None:
    overlay, objects = composed
    helios = by_kind(objects, "Deployment")["helios"]
    config = _used_epp_config(objects)
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    engine = helios["spec"]["template"]["metadata"]["labels"][extractor["engineLabelKey"]]
    vllm_metrics = "--vllm-metrics" in container(helios, "helios")["args"]
    assert (engine, vllm_metrics) == (("vllm", True) if overlay == "vllm-metrics" else ("helios", False))
    assert engine in engine_configs(config)


def test_helios_arguments_are_valid_run_options(composed: tuple[str, list[Manifest]]) -> None:
    _, objects = composed
    helios = by_kind(objects, "Deployment")["helios"]
    main = container(helios, "helios")
    assert main["command"] == ["helios"]
    parsed = build_parser().parse_args(main["args"])
    assert (parsed.command, parsed.host, parsed.port) == ("run", "0.0.0.0", 8000)
    # gateway replicas run the model worker in its own process (HTTP and scrapes keep their own GIL)
    assert parsed.worker_process is True
    # trust: the key file comes from the Secret mounted where --trust-key points, the acceptance from the Secret
    mounts = {mount["name"]: mount["mountPath"] for mount in main["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in helios["spec"]["template"]["spec"]["volumes"]}
    trust = volumes["trust"]["secret"]
    key_paths = {f"{mounts['trust']}/{item['path']}" for item in trust["items"]}
    assert [str(path) for path in parsed.trust_key] == ["/etc/helios/trust/signing.pub.pem"]
    assert str(parsed.trust_key[0]) in key_paths
    accept = next(variable for variable in main["env"] if variable["name"] == "HELIOS_ACCEPT")
    assert accept["valueFrom"]["secretKeyRef"]["name"] == trust["secretName"]
    # the core comes from the read-only volume
    assert str(parsed.core).startswith(mounts["cores"] + "/")
    assert volumes["cores"]["persistentVolumeClaim"]["claimName"] in by_kind(objects, "PersistentVolumeClaim")


def test_probes_use_health_for_liveness_and_ready_for_startup_and_readiness(
    composed: tuple[str, list[Manifest]],
) -> None:
    _, objects = composed
    main = container(by_kind(objects, "Deployment")["helios"], "helios")
    paths = {probe: (main[probe]["httpGet"]["path"], main[probe]["httpGet"]["port"])
             for probe in ("startupProbe", "livenessProbe", "readinessProbe")}  # fmt: skip
    assert paths == {
        "startupProbe": ("/ready", "http"),  # /health is 200 while the core loads: it bounds nothing
        "livenessProbe": ("/health", "http"),
        "readinessProbe": ("/ready", "http"),
    }


def test_the_grace_period_covers_the_prestop_sleep_and_the_shutdown_timeout(
    composed: tuple[str, list[Manifest]],
) -> None:
    _, objects = composed
    helios = by_kind(objects, "Deployment")["helios"]
    main = container(helios, "helios")
    shutdown_timeout = build_parser().parse_args(main["args"]).shutdown_timeout
    pre_stop = main["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = helios["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert (pre_stop, shutdown_timeout, grace) == (5, 30, 5 + 30 + SHUTDOWN_MARGIN_SECONDS)
    epp_grace = by_kind(objects, "Deployment")["helios-epp"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert epp_grace >= grace


def test_the_precise_prefix_overlay_pairs_the_event_publisher_with_the_scorer() -> None:
    objects = build(KUSTOMIZATIONS["precise-prefix"])
    helios = by_kind(objects, "Deployment")["helios"]
    main = container(helios, "helios")
    events = parse_kv_events_config(option(main["args"], "--kv-events-config") or "")
    assert (events.enabled, events.publisher, events.endpoint) == (True, "zmq", "tcp://*:5557")
    assert binds(events.endpoint), "pod-discovery mode: every pod binds, the scheduler connects"
    assert re.fullmatch(r"kv@\$\(POD_IP\):8000@.+", events.topic)
    pod_ip = next(variable for variable in main["env"] if variable["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in main["ports"]
    config = _used_epp_config(objects)
    scorer = next(p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert scorer["kvEventsConfig"]["discoverPods"] is True
    assert scorer["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5557
    assert scorer["kvEventsConfig"]["topicFilter"] == "kv@"
    base_config = _used_epp_config(build(KUSTOMIZATIONS["base"]))
    approximate = next(p for p in base_config["plugins"] if p["type"] == "prefix-cache-scorer")["parameters"]
    assert scorer["tokenProcessorConfig"]["blockSize"] == approximate["blockSizeTokens"] == 16
    parsed = build_parser().parse_args(main["args"])
    assert parsed.kv_events_config == option(main["args"], "--kv-events-config")
    assert parsed.worker_process is True  # the publisher runs in the worker process, beside its cache


# ---------------------------------------------------------------------------- the checks catch broken manifests


def _base() -> list[Manifest]:
    return build(KUSTOMIZATIONS["base"])


def _one(kind: str, name: str) -> Manifest:
    return copy.deepcopy(by_kind(_base(), kind)[name])


def test_a_misspelled_deployment_field_is_refused() -> None:
    deployment = _one("Deployment", "helios")
    spec = deployment["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    found = problems(deployment, "1.32.0")
    assert len(found) == 1
    assert found[0].startswith("Deployment/helios: spec/template/spec: Additional properties are not allowed")
    assert "'terminationGracePeriodSecond' was unexpected" in found[0]


def test_a_wrongly_typed_deployment_field_is_refused() -> None:
    deployment = _one("Deployment", "helios")
    deployment["spec"]["replicas"] = "two"
    assert problems(deployment, "1.32.0") == [
        "Deployment/helios: spec/replicas: 'two' is not of type 'integer', 'null'"
    ]


def test_a_misspelled_probe_field_is_refused() -> None:
    deployment = _one("Deployment", "helios")
    main = container(deployment, "helios")
    main["readinessProbe"]["httpGet"]["paht"] = main["readinessProbe"]["httpGet"].pop("path")
    found = problems(deployment, "1.37.0")
    assert len(found) == 1 and "'paht' was unexpected" in found[0]


def test_a_misspelled_inferencepool_field_is_refused() -> None:
    pool = _one("InferencePool", "helios")
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    assert problems(pool, "1.32.0") == [
        "InferencePool/helios: spec: 'targetPorts' is a required property",
        "InferencePool/helios: spec: Additional properties are not allowed ('targetPort' was unexpected)",
    ]


def test_a_wrongly_typed_inferencepool_port_is_refused() -> None:
    pool = _one("InferencePool", "helios")
    pool["spec"]["targetPorts"] = [{"number": "8000"}]
    assert problems(pool, "1.32.0") == [
        "InferencePool/helios: spec/targetPorts/0/number: '8000' is not of type 'integer'"
    ]


def test_an_endpoint_picker_reference_without_a_port_is_refused() -> None:
    pool = _one("InferencePool", "helios")
    del pool["spec"]["endpointPickerRef"]["port"]
    assert problems(pool, "1.32.0") == [
        "InferencePool/helios: spec/endpointPickerRef: port is required when kind is 'Service' or unspecified"
    ]


def test_a_misspelled_httproute_field_is_refused() -> None:
    route = _one("HTTPRoute", "helios")
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    found = problems(route, "1.32.0")
    assert found == [
        "HTTPRoute/helios: spec/rules/0: Additional properties are not allowed ('backendRef' was unexpected)"
    ]


def test_an_unknown_kind_is_refused() -> None:
    pool = _one("InferencePool", "helios")
    pool["apiVersion"] = "inference.networking.x-k8s.io/v1alpha2"
    assert problems(pool, "1.32.0") == [
        "InferencePool/helios: no schema for inference.networking.x-k8s.io/v1alpha2 InferencePool"
    ]


def test_a_misspelled_endpoint_picker_config_field_is_refused() -> None:
    config = copy.deepcopy(_used_epp_config(_base()))
    config["schedulingProfile"] = config.pop("schedulingProfiles")
    assert epp_config_problems(config) == [
        ": 'schedulingProfiles' is a required property",
        ": Additional properties are not allowed ('schedulingProfile' was unexpected)",
    ]


def test_a_wrongly_typed_extractor_parameter_is_refused() -> None:
    config = copy.deepcopy(_used_epp_config(_base()))
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    extractor["parameters"]["engineConfigs"][0]["queuedRequestsSpec"] = 5
    assert epp_config_problems(config) == [
        "plugins/1/parameters/engineConfigs/0/queuedRequestsSpec: 5 is not of type 'string'"
    ]


def test_a_reference_to_an_undeclared_plugin_is_refused() -> None:
    config = copy.deepcopy(_used_epp_config(_base()))
    config["schedulingProfiles"][0]["plugins"].append({"pluginRef": "session-affinity-scorer"})
    assert epp_config_problems(config) == ["pluginRef 'session-affinity-scorer' names no declared plugin"]


def test_a_metric_name_the_server_does_not_export_is_refused() -> None:
    config = copy.deepcopy(_used_epp_config(_base()))
    engine_configs(config)["helios"]["queuedRequestsSpec"] = "helios_requests_waiting"
    rest = "'helios_num_requests_running', 'helios_kv_cache_usage_ratio', 'helios_cache_config_info')"
    mapped, exported = f"('helios_requests_waiting', {rest}", f"('helios_num_requests_waiting', {rest}"
    assert metric_mapping_problems(config) == [f"engine 'helios' maps {mapped}, the server exports {exported}"]


def test_kustomize_refuses_a_patch_that_matches_nothing(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(KUSTOMIZATIONS["base"])],
                "patches": [
                    {"target": {"kind": "Deployment", "name": "helio"}, "patch": "- op: remove\n  path: /spec"}
                ],
            }
        ),
        encoding="utf-8",
    )
    with pytest.raises(KustomizeError, match="matches no resource"):
        build(tmp_path)


def test_kustomize_refuses_a_field_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [str(KUSTOMIZATIONS["base"])], "commonLabels": {"team": "a"}}), encoding="utf-8"
    )
    with pytest.raises(KustomizeError, match=r"unsupported fields \['commonLabels'\]"):
        build(tmp_path)
