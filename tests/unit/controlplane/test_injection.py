"""The sidecar-injection webhook on AdmissionReview fixtures: what a pod looks like after
the API server applies the patch, for vLLM and SGLang pods, re-injection, other pods and
malformed reviews."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest

from controlplane.admission.injection import InjectionConfig, mutate, mutate_review
from controlplane.admission.webhook import injection_config
from controlplane.settings import ControlPlaneSettings
from tests.unit.controlplane.admission import review, sglang_pod, vllm_pod

CONFIG = InjectionConfig(sidecar_image="kvroute/sidecar:test", nats_url="nats://nats:4222")
EVENTS = (
    '{"enable_kv_cache_events":true,"publisher":"zmq",'
    '"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
)


def admit(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(response, the pod as the API server would store it after the patch)."""
    answer = mutate(json.dumps(review(pod)).encode(), CONFIG)
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["allowed"] is True
    if "patch" not in response:
        return response, pod
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return response, jsonpatch.apply_patch(pod, ops)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_vllm_pod_gets_the_sidecar_and_kv_events() -> None:
    response, pod = admit(vllm_pod(**{"kvroute.io/pool": "llama", "kvroute.io/served-names": "l3"}))
    assert response["uid"] == "uid-1"
    engine, sidecar = pod["spec"]["containers"]
    assert engine["args"] == [
        "--model",
        "/models/llama",
        "--port",
        "8000",
        "--kv-events-config",
        EVENTS,
        "--enable-prompt-tokens-details",  # what the proxies compare their predictions with
    ]
    assert sidecar["name"] == "kvroute-sidecar"
    assert sidecar["image"] == "kvroute/sidecar:test"
    assert env_of(sidecar) == {
        "KVROUTE_REPLICA_ID": {"fieldRef": {"fieldPath": "metadata.name"}},
        # what the proxies, in other pods, call: the pod's IP, not the sidecar's loopback
        "KVROUTE_ADVERTISE_HOST": {"fieldRef": {"fieldPath": "status.podIP"}},
        "KVROUTE_ENGINE_URL": "http://127.0.0.1:8000",
        "KVROUTE_ENGINE_KIND": "vllm",
        "KVROUTE_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:5557",
        "KVROUTE_REPLAY_ENDPOINT": "tcp://127.0.0.1:5558",
        "KVROUTE_NATS_URL": "nats://nats:4222",
        "KVROUTE_POOL": "llama",
        "KVROUTE_MODEL": "meta-llama/Llama-3.1-8B",
        "KVROUTE_SERVED_NAMES": "l3",
        "KVROUTE_HOST": "0.0.0.0",
        "KVROUTE_PORT": "9100",
        "KVROUTE_DRAIN_S": "30",  # on SIGTERM: announced draining, 30 s before it stops
    }
    # the engine serves while the sidecar drains; the grace covers the drain and its stop
    assert engine["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "30"]}}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["metadata"]["annotations"]["kvroute.io/injected"] == "true"


def test_sglang_pod_gets_its_own_events_config_and_metrics() -> None:
    _, pod = admit(sglang_pod())
    engine, sidecar = pod["spec"]["containers"]
    flag = engine["args"].index("--kv-events-config")
    config = json.loads(engine["args"][flag + 1])
    assert config == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
    }
    assert "--enable-metrics" in engine["args"] and "--enable-cache-report" in engine["args"]
    env = env_of(sidecar)
    assert env["KVROUTE_ENGINE_KIND"] == "sglang"
    assert env["KVROUTE_MODEL"] == "Qwen/Qwen2.5-7B"  # from --model-path
    assert env["KVROUTE_ENGINE_URL"] == "http://127.0.0.1:30000"
    assert env["KVROUTE_POOL"] == "default"
    assert pod["metadata"]["annotations"] == {"kvroute.io/injected": "true"}


def test_an_existing_events_config_is_kept_and_its_ports_followed() -> None:
    pod = vllm_pod()
    given = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:6000"}'
    pod["spec"]["containers"][0]["args"] += [
        f"--kv-events-config={given}",
        "--enable-prompt-tokens-details",
    ]
    _, patched = admit(pod)
    engine, sidecar = patched["spec"]["containers"]
    assert engine["args"] == pod["spec"]["containers"][0]["args"]
    env = env_of(sidecar)
    assert env["KVROUTE_KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:6000"
    assert "KVROUTE_REPLAY_ENDPOINT" not in env  # the engine has no replay socket


def test_annotations_choose_container_ports_and_block_size() -> None:
    pod = vllm_pod(
        **{
            "kvroute.io/engine-container": "engine",
            "kvroute.io/engine-port": "9000",
            "kvroute.io/kv-events-port": "7001",
            "kvroute.io/replay-port": "7002",
            "kvroute.io/block-size": "32",
        }
    )
    helper = {"name": "log-shipper", "image": "busybox"}
    pod["spec"]["containers"] = [helper, {**pod["spec"]["containers"][0], "name": "engine"}]
    _, patched = admit(pod)
    assert patched["spec"]["containers"][0] == helper
    engine = patched["spec"]["containers"][1]
    assert json.loads(engine["args"][-2])["endpoint"] == "tcp://*:7001"
    env = env_of(patched["spec"]["containers"][2])
    assert env["KVROUTE_ENGINE_URL"] == "http://127.0.0.1:9000"
    assert env["KVROUTE_REPLAY_ENDPOINT"] == "tcp://127.0.0.1:7002"
    assert env["KVROUTE_ROUTER_BLOCK_SIZE"] == "32"


def test_the_served_model_name_is_the_model_without_an_annotation() -> None:
    pod = vllm_pod()
    del pod["metadata"]["annotations"]["kvroute.io/model"]
    pod["spec"]["containers"][0]["args"] += ["--served-model-name", "llama-8b", "llama"]
    _, patched = admit(pod)
    assert env_of(patched["spec"]["containers"][1])["KVROUTE_MODEL"] == "llama-8b"


def test_vllm_serve_positional_model_and_no_args_field() -> None:
    pod = vllm_pod()
    del pod["metadata"]["annotations"]
    pod["spec"]["containers"][0] = {
        "name": "vllm",
        "image": "vllm/vllm-openai",
        "command": ["vllm", "serve", "Qwen/Qwen3-8B"],
    }
    _, patched = admit(pod)
    engine, sidecar = patched["spec"]["containers"]
    assert engine["args"] == ["--kv-events-config", EVENTS, "--enable-prompt-tokens-details"]
    assert env_of(sidecar)["KVROUTE_MODEL"] == "Qwen/Qwen3-8B"


def test_engine_args_can_be_left_alone() -> None:
    pod = sglang_pod()
    pod["metadata"]["annotations"] = {"kvroute.io/patch-engine-args": "false"}
    _, patched = admit(pod)
    engine, sidecar = patched["spec"]["containers"]
    lifecycle = engine.pop("lifecycle")  # the drain's preStop sleep is not an argument
    assert lifecycle["preStop"]["exec"]["command"][0] == "sleep"
    assert engine == pod["spec"]["containers"][0]
    assert env_of(sidecar)["KVROUTE_KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:5557"


def test_termination_drain_follows_the_config_and_keeps_what_the_pod_has() -> None:
    pod = vllm_pod()
    pod["spec"]["terminationGracePeriodSeconds"] = 10  # too short for the drain: raised
    config = InjectionConfig(sidecar_image="s", nats_url="nats://n:4222", drain_s=45.5)
    patched, warnings = apply(pod, config)
    engine, sidecar = patched["spec"]["containers"]
    assert env_of(sidecar)["KVROUTE_DRAIN_S"] == "45.5"
    assert engine["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "46"]}}
    assert patched["spec"]["terminationGracePeriodSeconds"] == 76
    assert warnings == []

    pod = vllm_pod()
    pod["spec"]["terminationGracePeriodSeconds"] = 600  # longer: kept
    own_hook = {"exec": {"command": ["/bin/stop-gracefully"]}}
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": own_hook}
    patched, warnings = apply(pod, CONFIG)
    engine = patched["spec"]["containers"][0]
    assert engine["lifecycle"] == {"preStop": own_hook}
    assert patched["spec"]["terminationGracePeriodSeconds"] == 600
    assert len(warnings) == 1 and "preStop" in warnings[0] and "30 s" in warnings[0]

    off = InjectionConfig(sidecar_image="s", nats_url="nats://n:4222", drain_s=0)
    patched, _ = apply(vllm_pod(), off)
    engine, sidecar = patched["spec"]["containers"]
    assert env_of(sidecar)["KVROUTE_DRAIN_S"] == "0" and "lifecycle" not in engine
    assert "terminationGracePeriodSeconds" not in patched["spec"]


def test_the_control_planes_settings_choose_the_drain() -> None:
    settings = ControlPlaneSettings(inject_drain_s=12)
    assert injection_config(settings).drain_s == 12
    assert injection_config(ControlPlaneSettings()).drain_s == 30


def apply(pod: dict[str, Any], config: InjectionConfig) -> tuple[dict[str, Any], list[str]]:
    response = mutate_review(review(pod), config)["response"]
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(pod, ops), response.get("warnings", [])


def test_nats_secret_becomes_the_sidecars_env() -> None:
    config = InjectionConfig(sidecar_image="s", nats_url="nats://n:4222", nats_secret="nats-auth")
    answer = mutate_review(review(vllm_pod()), config)
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    sidecar = next(op["value"] for op in ops if op["path"] == "/spec/containers/-")
    assert sidecar["envFrom"] == [{"secretRef": {"name": "nats-auth", "optional": True}}]


def test_reinjection_returns_the_pod_unchanged() -> None:
    _, injected = admit(vllm_pod())
    response, again = admit(copy.deepcopy(injected))
    assert "patch" not in response
    assert again == injected
    assert len(again["spec"]["containers"]) == 2


@pytest.mark.parametrize(
    "change",
    [
        lambda pod: pod["metadata"]["labels"].pop("kvroute.io/inject"),
        lambda pod: pod["metadata"]["labels"].update({"kvroute.io/inject": "false"}),
        lambda pod: pod["metadata"].pop("labels"),
    ],
    ids=["unlabelled", "label-false", "no-labels"],
)
def test_other_pods_are_left_alone(change: Any) -> None:
    pod = vllm_pod()
    change(pod)
    response, after = admit(pod)
    assert response == {"uid": "uid-1", "allowed": True}
    assert after == pod


def test_updates_and_other_kinds_are_left_alone() -> None:
    update = mutate_review(review(vllm_pod(), operation="UPDATE"), CONFIG)["response"]
    assert update == {"uid": "uid-1", "allowed": True}
    other = review({"metadata": {"labels": {"kvroute.io/inject": "true"}}})
    other["request"]["kind"]["kind"] = "Deployment"
    assert mutate_review(other, CONFIG)["response"] == {"uid": "uid-1", "allowed": True}


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"\xff\xfe", b"[]", b"null", b'{"request": 5}', b'{"kind": "x"}'],
)
def test_malformed_reviews_are_allowed_with_a_warning(body: bytes) -> None:
    answer = mutate(body, CONFIG)
    response = answer["response"]
    assert response["allowed"] is True
    assert "patch" not in response
    assert response["warnings"][0].startswith("kvroute: ")


def broken(path: str, value: object) -> dict[str, Any]:
    pod = vllm_pod()
    del pod["metadata"]["annotations"]["kvroute.io/model"]
    target = pod
    *parents, last = path.split(".")
    for part in parents:
        target = target[part] if not part.isdigit() else target[int(part)]
    target[last] = value
    return pod


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        (broken("spec", "x"), "spec is not an object"),
        (broken("spec.containers", {}), "spec.containers is not a list"),
        (broken("spec.containers", []), "no containers"),
        (broken("metadata.annotations", {"kvroute.io/pool": 3}), "not a string"),
        (broken("spec.containers.0.args", ["--port", "8000"]), "no kvroute.io/model"),
        (vllm_pod(**{"kvroute.io/engine-kind": "tgi"}), "vllm or sglang"),
        (vllm_pod(**{"kvroute.io/engine-port": "80a"}), "not a port"),
        (vllm_pod(**{"kvroute.io/replay-port": "70000"}), "not a port"),
        (vllm_pod(**{"kvroute.io/engine-container": "nope"}), "does not have"),
        (broken("spec.containers.0.args", ["--model", 7]), "must be strings"),
        (broken("spec.containers.0.args", ["--kv-events-config", "{"]), "is not JSON"),
        (broken("spec.containers.0.args", ["--kv-events-config", "[" * 100_000]), "is not JSON"),
    ],
)
def test_labelled_pods_that_cannot_be_injected_get_a_warning(
    pod: dict[str, Any], says: str
) -> None:
    response, after = admit(pod)
    assert "patch" not in response
    assert after == pod
    assert says in response["warnings"][0]
    assert response["uid"] == "uid-1"


def test_a_shell_wrapped_engine_gets_the_sidecar_and_a_warning() -> None:
    pod = vllm_pod()
    pod["spec"]["containers"][0]["command"] = ["sh", "-c"]
    pod["spec"]["containers"][0]["args"] = ["vllm serve /models/llama"]
    response, patched = admit(pod)
    assert patched["spec"]["containers"][0]["args"] == pod["spec"]["containers"][0]["args"]
    assert patched["spec"]["containers"][0]["command"] == ["sh", "-c"]
    assert patched["spec"]["containers"][1]["name"] == "kvroute-sidecar"
    assert "--kv-events-config" in response["warnings"][0]
