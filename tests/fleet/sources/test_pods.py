"""What a pod means to the fleet, and the steps that make the fleet follow the pods."""

from __future__ import annotations

from typing import Any

from narwhal.config.discovery import DiscoveryConfig
from narwhal.config.engine_spec import EngineSpec, Role
from narwhal.fleet.sources.pods import Action, Held, PodView, plan, read_pod
from support.kube_api import pod, set_ready

CONFIG = DiscoveryConfig(enabled=True, label_selector="app=vllm")


def view(body: dict[str, Any], config: DiscoveryConfig = CONFIG) -> PodView:
    return read_pod(body, config)


def test_a_ready_pod_is_its_engine_at_its_ip_and_annotated_port() -> None:
    seen = view(pod("d0", 8200, "decode", ip="10.1.2.3"))
    assert seen == PodView(
        "d0", EngineSpec("d0", "http://10.1.2.3:8200", Role.DECODE), True, "ready"
    )


def test_seat_limits_come_from_annotations() -> None:
    notes = {"narwhal/max-prefill-seats": "4", "narwhal/max-decode-seats": "16"}
    spec = view(pod("b0", 8000, "both", annotations=notes)).spec
    assert spec is not None and (spec.max_prefill_seats, spec.max_decode_seats) == (4, 16)


def test_the_model_comes_from_an_annotation_or_a_label_else_none() -> None:
    notes = {"narwhal/model": "meta-llama/Llama-3.1-8B-Instruct"}
    spec = view(pod("d1", 8000, "decode", annotations=notes)).spec
    assert spec is not None and spec.model == "meta-llama/Llama-3.1-8B-Instruct"
    spec = view(pod("d2", 8000, "decode", labels={"narwhal/model": "qwen-7b"})).spec
    assert spec is not None and spec.model == "qwen-7b"
    spec = view(pod("d3", 8000, "decode")).spec
    assert spec is not None and spec.model is None, "learnt from its /v1/models instead"


def test_the_role_may_be_a_label() -> None:
    spec = view(pod("p0", 8000, None, labels={"narwhal/role": "prefill"})).spec
    assert spec is not None and spec.role is Role.PREFILL


def test_a_pod_without_a_role_is_not_an_engine_unless_a_default_is_set() -> None:
    assert view(pod("x", 8000, None)) == PodView(
        "x", None, False, "no role: annotation or label narwhal/role"
    )
    spec = view(pod("x", 8000, None), DiscoveryConfig(default_role="both")).spec
    assert spec is not None and spec.role is Role.BOTH


def test_a_pod_without_an_ip_is_ignored() -> None:
    assert view(pod("d0", 8000, "decode", ip=None)).reason == "no pod IP yet"


def test_bad_annotations_name_themselves() -> None:
    assert view(pod("d0", 8000, "leader")).reason == "narwhal/role is 'leader': not a role"
    bad_seats = pod("d0", 8000, "decode", annotations={"narwhal/max-decode-seats": "many"})
    assert view(bad_seats).reason == "narwhal/max-decode-seats is 'many': not a seat count"
    bad_port = pod("d0", 8000, "decode", annotations={"narwhal/port": "99999"})
    assert view(bad_port).reason == "narwhal/port is '99999': not a port"


def test_the_port_may_be_a_named_container_port_or_the_default() -> None:
    body = pod("d0", 8300, "decode")
    del body["metadata"]["annotations"]["narwhal/port"]
    assert view(body).spec.url.endswith(":8000")  # type: ignore[union-attr]
    named = DiscoveryConfig(port_name="http")
    assert view(body, named).spec.url.endswith(":8300")  # type: ignore[union-attr]
    assert view(body, DiscoveryConfig(port_name="grpc")).reason == "no container port named grpc"


def test_an_ipv6_pod_ip_is_bracketed() -> None:
    spec = view(pod("d0", 8000, "decode", ip="fd00::5")).spec
    assert spec is not None and spec.url == "http://[fd00::5]:8000"


def test_an_unready_or_terminating_pod_is_an_engine_that_takes_no_work() -> None:
    body = pod("d0", 8000, "decode")
    set_ready(body, False)
    assert (view(body).spec is not None, view(body).ready, view(body).reason) == (
        True,
        False,
        "not ready",
    )
    body = pod("d0", 8000, "decode")
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert (view(body).ready, view(body).reason) == (False, "terminating")
    body = pod("d0", 8000, "decode")
    body["status"]["phase"] = "Pending"
    assert view(body).reason == "phase Pending"


def test_a_name_too_long_for_an_engine_id_is_ignored() -> None:
    assert view(pod("d" * 65, 8000, "decode")).spec is None


# The plan ----------------------------------------------------------------------------


def spec(name: str, port: int = 8000, role: Role = Role.DECODE) -> EngineSpec:
    return EngineSpec(name, f"http://10.0.0.1:{port}", role)


def ready(name: str, port: int = 8000, role: Role = Role.DECODE) -> PodView:
    return PodView(name, spec(name, port, role), True, "ready")


def unready(name: str, port: int = 8000) -> PodView:
    return PodView(name, spec(name, port), False, "not ready")


def steps(
    held: dict[str, Held], pods: list[PodView], others: dict[str, str] | None = None
) -> list[tuple[Action, str]]:
    result = plan(held, {p.name: p for p in pods}, others or {})
    return [(s.action, s.engine_id) for s in result.steps]


def test_a_ready_pod_new_to_the_fleet_is_added() -> None:
    assert steps({}, [ready("d0")]) == [(Action.ADD, "d0")]


def test_an_unready_pod_new_to_the_fleet_waits_outside_it() -> None:
    assert steps({}, [unready("d0")]) == []


def test_a_pod_turning_unready_drains_its_engine_once() -> None:
    assert steps({"d0": Held(spec("d0"))}, [unready("d0")]) == [(Action.DRAIN, "d0")]
    drained = Held(spec("d0"), draining=True, drained_here=True)
    assert steps({"d0": drained}, [unready("d0")]) == []


def test_a_pod_ready_again_is_undrained_but_not_one_an_operator_drained() -> None:
    ours = Held(spec("d0"), draining=True, drained_here=True)
    assert steps({"d0": ours}, [ready("d0")]) == [(Action.UNDRAIN, "d0")]
    operators = Held(spec("d0"), draining=True)
    assert steps({"d0": operators}, [ready("d0")]) == []


def test_a_pod_gone_removes_its_engine_once() -> None:
    assert steps({"d0": Held(spec("d0"))}, []) == [(Action.REMOVE, "d0")]
    leaving = Held(spec("d0"), draining=True, removing=True)
    assert steps({"d0": leaving}, []) == []


def test_a_pod_back_while_its_engine_is_leaving_stays() -> None:
    leaving = Held(spec("d0"), draining=True, removing=True)
    assert steps({"d0": leaving}, [ready("d0")]) == [(Action.UNDRAIN, "d0")]


def test_new_seats_or_role_change_in_place() -> None:
    changed = PodView("d0", EngineSpec("d0", spec("d0").url, Role.BOTH), True, "ready")
    result = plan({"d0": Held(spec("d0"))}, {"d0": changed}, {})
    assert [(s.action, s.spec) for s in result.steps] == [(Action.CHANGE, changed.spec)]


def test_a_pod_at_a_new_url_replaces_its_engine_once_the_old_one_is_gone() -> None:
    held = {"d0": Held(spec("d0", 8000))}
    result = plan(held, {"d0": ready("d0", 9000)}, {})
    assert [(s.action, s.engine_id) for s in result.steps] == [(Action.REMOVE, "d0")]
    assert result.waiting == {"d0": "its old engine at http://10.0.0.1:8000 is still draining"}
    assert steps({}, [ready("d0", 9000)]) == [(Action.ADD, "d0")]


def test_a_pod_whose_url_or_id_is_taken_waits() -> None:
    result = plan({}, {"d1": ready("d1", 8000)}, {"static": "http://10.0.0.1:8000"})
    assert result.steps == () and result.waiting == {
        "d1": "url http://10.0.0.1:8000 is still engine static's"
    }
    result = plan({}, {"d1": ready("d1", 8000)}, {"d1": "http://10.9.9.9:1"})
    assert result.steps == () and result.waiting == {"d1": "engine id d1 is a configured engine's"}


def test_two_pods_at_one_url_make_one_engine() -> None:
    assert steps({}, [ready("a", 8000), ready("b", 8000)]) == [(Action.ADD, "a")]
