"""Sidecar injection: the mutating admission webhook's logic, as one pure function.

Kubernetes calls ``POST /mutate`` on the control plane's admin app (an AdmissionReview
v1) for every pod created in a namespace the ``MutatingWebhookConfiguration`` selects.
For a pod labelled ``kvroute.io/inject: "true"`` this module answers with a JSONPatch that

- appends the ``kvroute-sidecar`` container, configured from the pod's annotations
  (table below) through ``KVROUTE_*`` environment variables;
- turns the engine's KV events on when its arguments do not already: vLLM gets
  ``--kv-events-config {"enable_kv_cache_events":true,"publisher":"zmq",...}``, SGLang
  gets ``--kv-events-config {"publisher":"zmq",...}`` (its publisher defaults to
  ``null``) and ``--enable-metrics`` (the sidecar reads load from ``/metrics``);
- turns the engine's report of cached tokens on (``usage.prompt_tokens_details``, which
  the proxies compare with their predictions): vLLM's ``--enable-prompt-tokens-details``,
  SGLang's ``--enable-cache-report``;
- makes termination drain (``--inject-drain-s``, 30 s; 0 = off): the sidecar gets
  ``KVROUTE_DRAIN_S``, the engine a preStop ``sleep`` as long (unless it has a preStop
  hook) so that it serves while proxies stop sending to it, and the pod a
  ``terminationGracePeriodSeconds`` of at least the drain plus 30 s;
- marks the pod ``kvroute.io/injected: "true"``.

The sidecar reads the engine on loopback and announces it to the proxies at the pod's
IP (``KVROUTE_ADVERTISE_HOST`` from the downward API's ``status.podIP``): the engine's
loopback address means nothing to a proxy in another pod.

A pod that already has the sidecar is returned unchanged (idempotent), every other pod
is left alone, and nothing here raises: a review that cannot be read is answered
``allowed: true`` with no patch and a warning, because the webhook runs with
``failurePolicy: Ignore`` and must never be the reason an engine pod does not start.

Annotations (all optional but the model, which can also come from the engine's
``--served-model-name``, ``--model`` or ``--model-path`` flag, or ``vllm serve MODEL``):

====================================  ==========================================
``kvroute.io/model``                  canonical model id (part of every router key)
``kvroute.io/engine-kind``            ``vllm`` or ``sglang`` (else guessed from the
                                      engine container's image and command)
``kvroute.io/pool``                   the replica's pool (``default``)
``kvroute.io/engine-container``       the engine container's name (the first one)
``kvroute.io/engine-port``            engine HTTP port (its first containerPort, else
                                      8000 for vLLM, 30000 for SGLang)
``kvroute.io/kv-events-port``         ZMQ PUB port (5557)
``kvroute.io/replay-port``            ZMQ replay port (5558)
``kvroute.io/served-names``           other names served, comma-separated
``kvroute.io/block-size``             router block size (the sidecar's default, 16)
``kvroute.io/patch-engine-args``      ``"false"``: leave the engine's arguments as they
                                      are (an engine that publishes events without
                                      flags, such as ``kvroute-sim``)
====================================  ==========================================

The replica id is the pod's name (downward API), so it must be a valid subject token
(``[A-Za-z0-9_-]``): Deployment and StatefulSet pod names are.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

INJECT_LABEL = "kvroute.io/inject"
INJECTED_ANNOTATION = "kvroute.io/injected"
SIDECAR_NAME = "kvroute-sidecar"
ANNOTATION_PREFIX = "kvroute.io/"
ENGINE_KINDS = ("vllm", "sglang")
DEFAULT_ENGINE_PORTS = {"vllm": 8000, "sglang": 30000}
DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558
KV_EVENTS_FLAG = "--kv-events-config"
SGLANG_METRICS_FLAG = "--enable-metrics"
CACHE_REPORT_FLAGS = {"vllm": "--enable-prompt-tokens-details", "sglang": "--enable-cache-report"}
MODEL_FLAGS = ("--served-model-name", "--model", "--model-path")
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
ENGINE_STOP_S = 30  # grace beyond the drain for the engine to stop after its preStop

Json = dict[str, Any]


class InvalidPod(ValueError):
    """A labelled pod that cannot be injected (the message becomes a warning)."""


@dataclass(frozen=True, slots=True)
class InjectionConfig:
    """What the control plane puts into every injected sidecar."""

    sidecar_image: str
    nats_url: str
    nats_secret: str = ""  # a Secret whose keys become env (e.g. KVROUTE_NATS_TOKEN)
    sidecar_port: int = 9100
    image_pull_policy: str = "IfNotPresent"
    drain_s: float = 30.0  # the sidecar's --drain-s: how long a terminating pod drains


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The engine as read from the pod: which container, what kind, which ports."""

    index: int
    kind: str
    model: str
    pool: str
    http_port: int
    events_port: int
    replay_port: int | None  # None: the engine has no replay socket
    served_names: str
    block_size: str
    has_events_config: bool
    patch_args: bool


# --- the entry points -------------------------------------------------------------------


def mutate(body: bytes, config: InjectionConfig) -> Json:
    """The AdmissionReview v1 response for a request body; never raises."""
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _review(_allowed("", ["kvroute: the AdmissionReview is not JSON; not injected"]))
    return mutate_review(review, config)


def mutate_review(review: object, config: InjectionConfig) -> Json:
    """The AdmissionReview v1 response for a decoded review; never raises."""
    request = review.get("request") if isinstance(review, dict) else None
    if not isinstance(request, dict):
        return _review(_allowed("", ["kvroute: the AdmissionReview has no request; not injected"]))
    uid = request.get("uid")
    uid = uid if isinstance(uid, str) else ""
    try:
        patch, warnings = pod_patch(request, config)
    except InvalidPod as exc:
        return _review(_allowed(uid, [f"kvroute: {exc}; not injected"]))
    except Exception as exc:  # a bug must not block pods: failurePolicy is Ignore anyway
        return _review(_allowed(uid, [f"kvroute: injection failed ({type(exc).__name__})"]))
    response = _allowed(uid, warnings)
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return _review(response)


def pod_patch(request: Json, config: InjectionConfig) -> tuple[list[Json], list[str]]:
    """The JSONPatch operations for one admission request, and warnings for the user.

    An empty patch means the pod is left as it is (not a pod, not labelled, not a
    CREATE, or already injected)."""
    pod = request.get("object")
    if not _wants_injection(request, pod):
        return [], []
    assert isinstance(pod, dict)
    spec = _dict(pod.get("spec"), "spec")
    containers = _list(spec.get("containers"), "spec.containers")
    if any(isinstance(c, dict) and c.get("name") == SIDECAR_NAME for c in containers):
        return [], []
    metadata = _dict(pod.get("metadata", {}), "metadata")
    annotations = _string_map(metadata.get("annotations", {}), "metadata.annotations")
    engine = read_engine(containers, annotations)
    warnings: list[str] = []
    ops = engine_arg_ops(containers[engine.index], engine, warnings)
    ops += drain_ops(spec, containers[engine.index], engine, config, warnings)
    ops.append({"op": "add", "path": "/spec/containers/-", "value": sidecar(engine, config)})
    ops.append(_annotation_op(metadata))
    return ops, warnings


# --- which pods ------------------------------------------------------------------------


def _wants_injection(request: Json, pod: object) -> bool:
    kind = request.get("kind")
    if isinstance(kind, dict) and kind.get("kind") not in (None, "Pod"):
        return False
    if request.get("operation", "CREATE") != "CREATE" or not isinstance(pod, dict):
        return False
    metadata = pod.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, dict) else None
    return isinstance(labels, dict) and labels.get(INJECT_LABEL) == "true"


# --- reading the engine ------------------------------------------------------------------


def read_engine(containers: list[Any], annotations: Mapping[str, str]) -> EngineSpec:
    """The engine container and the sidecar's settings, from the pod's annotations."""
    index = _engine_index(containers, annotations.get(ANNOTATION_PREFIX + "engine-container"))
    container = _dict(containers[index], f"spec.containers[{index}]")
    argv = _argv(container)
    kind = _engine_kind(annotations, container, argv)
    events, replay, has_config = _event_ports(argv, annotations)
    return EngineSpec(
        index=index,
        kind=kind,
        model=_model(annotations, argv),
        pool=annotations.get(ANNOTATION_PREFIX + "pool", "default"),
        http_port=_http_port(annotations, container, kind),
        events_port=events,
        replay_port=replay,
        served_names=annotations.get(ANNOTATION_PREFIX + "served-names", ""),
        block_size=annotations.get(ANNOTATION_PREFIX + "block-size", ""),
        has_events_config=has_config,
        patch_args=annotations.get(ANNOTATION_PREFIX + "patch-engine-args") != "false",
    )


def _engine_index(containers: list[Any], name: str | None) -> int:
    if not containers:
        raise InvalidPod("the pod has no containers")
    if name is None:
        return 0
    for index, container in enumerate(containers):
        if isinstance(container, dict) and container.get("name") == name:
            return index
    raise InvalidPod(f"kvroute.io/engine-container names {name!r}, which the pod does not have")


def _argv(container: Json) -> list[str]:
    command = _list(container.get("command", []), "command")
    args = _list(container.get("args", []), "args")
    argv = command + args
    if not all(isinstance(arg, str) for arg in argv):
        raise InvalidPod("the engine container's command and args must be strings")
    return argv


def _engine_kind(annotations: Mapping[str, str], container: Json, argv: list[str]) -> str:
    kind = annotations.get(ANNOTATION_PREFIX + "engine-kind")
    if kind is not None:
        if kind not in ENGINE_KINDS:
            raise InvalidPod(f"kvroute.io/engine-kind must be vllm or sglang (got {kind!r})")
        return kind
    image = container.get("image")
    text = " ".join([image if isinstance(image, str) else "", *argv]).lower()
    return "sglang" if "sglang" in text else "vllm"


def _model(annotations: Mapping[str, str], argv: list[str]) -> str:
    model = annotations.get(ANNOTATION_PREFIX + "model") or flag_value(argv, MODEL_FLAGS)
    if not model and len(argv) >= 3 and argv[0].endswith("vllm") and argv[1] == "serve":
        model = argv[2] if not argv[2].startswith("-") else None
    if not model:
        raise InvalidPod("no kvroute.io/model annotation and no --model in the engine's args")
    return model


def _http_port(annotations: Mapping[str, str], container: Json, kind: str) -> int:
    given = annotations.get(ANNOTATION_PREFIX + "engine-port")
    if given is not None:
        return _port(given, "kvroute.io/engine-port")
    ports = container.get("ports")
    if isinstance(ports, list) and ports and isinstance(ports[0], dict):
        return _port(ports[0].get("containerPort"), "the engine's first containerPort")
    return DEFAULT_ENGINE_PORTS[kind]


def _event_ports(argv: list[str], annotations: Mapping[str, str]) -> tuple[int, int | None, bool]:
    """The ZMQ ports: from an existing ``--kv-events-config`` (no replay port when it
    has no ``replay_endpoint``), else the annotations."""
    events = _annotated_port(annotations, "kv-events-port", DEFAULT_EVENTS_PORT)
    replay = _annotated_port(annotations, "replay-port", DEFAULT_REPLAY_PORT)
    given = flag_value(argv, (KV_EVENTS_FLAG,))
    if given is None:
        return events, replay, False
    try:
        existing = json.loads(given)
    except (ValueError, RecursionError):
        raise InvalidPod(f"{KV_EVENTS_FLAG} is not JSON") from None
    if not isinstance(existing, dict):
        raise InvalidPod(f"{KV_EVENTS_FLAG} is not a JSON object")
    return (
        _endpoint_port(existing.get("endpoint"), DEFAULT_EVENTS_PORT) or DEFAULT_EVENTS_PORT,
        _endpoint_port(existing.get("replay_endpoint"), None),
        True,
    )


def _endpoint_port(endpoint: object, default: int | None) -> int | None:
    if not isinstance(endpoint, str):
        return default
    _, _, port = endpoint.rpartition(":")
    return int(port) if port.isdigit() and 0 < int(port) < 65536 else default


def _annotated_port(annotations: Mapping[str, str], name: str, default: int) -> int:
    return _port(annotations.get(ANNOTATION_PREFIX + name, default), ANNOTATION_PREFIX + name)


def flag_value(argv: list[str], flags: tuple[str, ...]) -> str | None:
    """The value of the first of ``flags`` (in their order) that ``argv`` has
    (``--f v`` or ``--f=v``)."""
    for flag in flags:
        for position, arg in enumerate(argv):
            if arg == flag and position + 1 < len(argv):
                return argv[position + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def has_flag(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


# --- the engine's arguments ------------------------------------------------------------


def engine_arg_ops(container: Json, engine: EngineSpec, warnings: list[str]) -> list[Json]:
    """Patch operations adding what the engine needs to publish events and load."""
    argv = _argv(container)
    missing = _missing_flags(argv, engine)
    if not missing or not engine.patch_args:
        return []
    if _shell_wrapped(argv):
        flags = " and ".join(arg for arg in missing if arg.startswith("--"))
        warnings.append(
            f"kvroute: the engine runs through a shell; add {flags} to its command yourself"
        )
        return []
    base = f"/spec/containers/{engine.index}/args"
    if "args" not in container:
        return [{"op": "add", "path": base, "value": missing}]
    return [{"op": "add", "path": base + "/-", "value": arg} for arg in missing]


def _missing_flags(argv: list[str], engine: EngineSpec) -> list[str]:
    missing: list[str] = []
    if not engine.has_events_config:
        missing += [KV_EVENTS_FLAG, json.dumps(events_config(engine), separators=(",", ":"))]
    if engine.kind == "sglang" and not has_flag(argv, SGLANG_METRICS_FLAG):
        missing.append(SGLANG_METRICS_FLAG)
    report = CACHE_REPORT_FLAGS.get(engine.kind)
    if report is not None and not has_flag(argv, report):
        missing.append(report)
    return missing


def events_config(engine: EngineSpec) -> Json:
    """The engine's ``--kv-events-config``: ZMQ PUB and replay bound on every address of
    the pod (the sidecar connects on loopback)."""
    config: Json = {"enable_kv_cache_events": True} if engine.kind == "vllm" else {}
    config |= {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{engine.events_port}",
    }
    if engine.replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{engine.replay_port}"
    return config


def _shell_wrapped(argv: list[str]) -> bool:
    return len(argv) >= 2 and argv[0] in SHELLS and argv[1].startswith("-")


# --- termination: drain before the engine stops -----------------------------------------


def drain_ops(
    spec: Json, container: Json, engine: EngineSpec, config: InjectionConfig, warnings: list[str]
) -> list[Json]:
    """On a pod's termination every container gets SIGTERM at once: the sidecar announces
    the replica draining and keeps running ``drain_s``; a preStop sleep as long keeps the
    engine serving the requests it has meanwhile, and the grace period covers both plus
    the engine's own stop (:data:`ENGINE_STOP_S`)."""
    if config.drain_s <= 0:
        return []
    ops: list[Json] = []
    grace = math.ceil(config.drain_s) + ENGINE_STOP_S
    given = spec.get("terminationGracePeriodSeconds")
    if not isinstance(given, int) or given < grace:
        op = "replace" if "terminationGracePeriodSeconds" in spec else "add"
        ops.append({"op": op, "path": "/spec/terminationGracePeriodSeconds", "value": grace})
    lifecycle = container.get("lifecycle")
    base = f"/spec/containers/{engine.index}/lifecycle"
    pre_stop = {"exec": {"command": ["sleep", str(math.ceil(config.drain_s))]}}
    if not isinstance(lifecycle, dict):
        ops.append({"op": "add", "path": base, "value": {"preStop": pre_stop}})
    elif "preStop" not in lifecycle:
        ops.append({"op": "add", "path": base + "/preStop", "value": pre_stop})
    else:
        warnings.append(
            f"kvroute: the engine has its own preStop hook; it should last the sidecar's "
            f"drain ({config.drain_s:g} s) so that the engine serves while the pod drains"
        )
    return ops


# --- the sidecar container ----------------------------------------------------------------


def sidecar(engine: EngineSpec, config: InjectionConfig) -> Json:
    """The ``kvroute-sidecar`` container for one engine."""
    container: Json = {
        "name": SIDECAR_NAME,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "env": sidecar_env(engine, config),
        "ports": [{"name": "kvroute-sidecar", "containerPort": config.sidecar_port}],
        # Alive while it accepts connections: its /healthz is 503 while NATS or the engine
        # is down, which a restart would not cure.
        "livenessProbe": {
            "tcpSocket": {"port": config.sidecar_port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if config.nats_secret:
        container["envFrom"] = [{"secretRef": {"name": config.nats_secret, "optional": True}}]
    return container


def sidecar_env(engine: EngineSpec, config: InjectionConfig) -> list[Json]:
    """``KVROUTE_*`` settings of the sidecar (names as in ``SidecarSettings``)."""
    values = {
        "KVROUTE_ENGINE_URL": f"http://127.0.0.1:{engine.http_port}",
        "KVROUTE_ENGINE_KIND": engine.kind,
        "KVROUTE_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{engine.events_port}",
        "KVROUTE_REPLAY_ENDPOINT": (
            f"tcp://127.0.0.1:{engine.replay_port}" if engine.replay_port else ""
        ),
        "KVROUTE_NATS_URL": config.nats_url,
        "KVROUTE_POOL": engine.pool,
        "KVROUTE_MODEL": engine.model,
        "KVROUTE_SERVED_NAMES": engine.served_names,
        "KVROUTE_ROUTER_BLOCK_SIZE": engine.block_size,
        "KVROUTE_HOST": "0.0.0.0",
        "KVROUTE_PORT": str(config.sidecar_port),
        "KVROUTE_DRAIN_S": f"{config.drain_s:g}",
    }
    env: list[Json] = [
        {"name": "KVROUTE_REPLICA_ID", "valueFrom": _field("metadata.name")},
        # the sidecar calls the engine on loopback; the proxies, in other pods, at the pod's IP
        {"name": "KVROUTE_ADVERTISE_HOST", "valueFrom": _field("status.podIP")},
    ]
    env += [{"name": name, "value": value} for name, value in values.items() if value]
    return env


def _field(path: str) -> Json:
    """A downward-API value of the pod."""
    return {"fieldRef": {"fieldPath": path}}


def _annotation_op(metadata: Json) -> Json:
    if "annotations" not in metadata:
        value = {INJECTED_ANNOTATION: "true"}
        return {"op": "add", "path": "/metadata/annotations", "value": value}
    path = "/metadata/annotations/" + INJECTED_ANNOTATION.replace("~", "~0").replace("/", "~1")
    return {"op": "add", "path": path, "value": "true"}


# --- small readers --------------------------------------------------------------------------


def _allowed(uid: str, warnings: list[str]) -> Json:
    response: Json = {"uid": uid, "allowed": True}
    if warnings:
        response["warnings"] = warnings
    return response


def _review(response: Json) -> Json:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _dict(value: object, where: str) -> Json:
    if not isinstance(value, dict):
        raise InvalidPod(f"{where} is not an object")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidPod(f"{where} is not a list")
    return value


def _string_map(value: object, where: str) -> dict[str, str]:
    mapping = _dict(value, where)
    if not all(isinstance(v, str) for v in mapping.values()):
        raise InvalidPod(f"{where} has a value that is not a string")
    return mapping


def _port(value: object, where: str) -> int:
    text = str(value)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InvalidPod(f"{where} is not a port (got {value!r})")
    return int(text)
