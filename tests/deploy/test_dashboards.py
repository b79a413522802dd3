"""The Grafana dashboard and the alert rules load, and name only what a router exports."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.stack import COMPLETION, arm, stack_factory

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
# Series Prometheus makes itself, and labels its scrape adds to every series.
PROMETHEUS_SERIES = {"up": {"job", "instance"}}
TARGET_LABELS = {"job", "instance"}
FUNCTIONS = {
    "sum",
    "max",
    "min",
    "count",
    "rate",
    "increase",
    "histogram_quantile",
    "clamp_min",
    "vector",
    "min_over_time",
}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"

Exported = dict[str, set[str]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """Every sample name a real router's `/metrics` shows, with its label names."""
    return asyncio.run(_scrape(tmp_path_factory.mktemp("dashboards")))


async def _scrape(tmp_path: Path) -> Exported:
    # A tenant brings out the per-tenant series (each configured tenant's from the start).
    async with stack_factory(tmp_path)(tenants=[{"name": "t"}]) as stack:
        # One success and one rejected descriptor bring out every labelled series.
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        arm(stack.engine("p0"), phase="prefill", descriptor="missing_engine_id", times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        async with stack.http.get(stack.url + "/metrics") as response:
            text = await response.text()
    names: Exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def selectors(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names matched) for each series selector in a PromQL expression."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(GROUPING, " ", expr)
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?", expr):
        name, matchers, call = match.groups()
        if call:
            assert name in FUNCTIONS, f"unknown PromQL function {name} in {expr}"
        elif name not in KEYWORDS:
            yield name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""))


def check_expression(expr: str, exported: Exported) -> set[str]:
    """Assert every series and label exists; return the metric names used."""
    known = {**exported, **PROMETHEUS_SERIES}
    all_labels = set().union(*exported.values()) | TARGET_LABELS
    used = set()
    for name, labels in selectors(expr):
        assert name in known, f"{name} is not exported by the router (in {expr!r})"
        assert labels <= known[name] | TARGET_LABELS, f"{name} has no label {labels} ({expr!r})"
        used.add(name)
    for group in re.findall(GROUPING, expr):
        names = {label.strip() for label in group.split(",") if label.strip()}
        assert names <= all_labels, f"grouping by unknown labels {names} in {expr!r}"
    assert used, f"no series in {expr!r}"
    return used


def expressions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def test_the_dashboard_names_only_exported_metrics(exported: Exported) -> None:
    dashboard = json.loads((DASHBOARDS / "grafana-narwhal.json").read_text())
    used: set[str] = set()
    for expr in expressions(dashboard["panels"]):
        used |= check_expression(expr, exported)
    for variable in dashboard["templating"]["list"]:
        definition = variable.get("definition")
        if definition:
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
            assert match is not None, definition
            selector, label = match.groups()
            check_expression(selector, exported)
            assert label in exported[selector.split("{")[0]] | TARGET_LABELS
    # The board covers the headline series.
    for name in (
        "narwhal_requests_total",
        "narwhal_ttft_seconds_bucket",
        "narwhal_first_byte_seconds_bucket",
        "narwhal_engine_state",
        "narwhal_engine_leg_failures_total",
        "narwhal_retry_budget_denials_total",
        "narwhal_event_loop_lag_seconds_bucket",
    ):
        assert name in used, name


def test_the_dashboard_has_an_overview_and_a_row_per_engine() -> None:
    dashboard = json.loads((DASHBOARDS / "grafana-narwhal.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "tenant", "engine"} <= variables
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Fleet overview", "Engine $engine"]
    assert rows[1]["repeat"] == "engine"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            after_engine_row = grid["y"] > rows[1]["gridPos"]["y"]
            selects_engine = all("$engine" in e for e in expressions(panel["targets"]))
            assert selects_engine == after_engine_row, panel["title"]


REQUEST_SERIES = (
    "narwhal_requests_total",
    "narwhal_request_errors_total",
    "narwhal_ttft_seconds_bucket",
    "narwhal_first_byte_seconds_bucket",
    "narwhal_first_byte_after_ttft_seconds_bucket",
    "narwhal_queue_wait_seconds_bucket",
    "narwhal_prefill_seconds_bucket",
    "narwhal_decode_seconds_bucket",
    "narwhal_attempts_total",
)


def test_the_model_variable_filters_every_request_panel(exported: Exported) -> None:
    dashboard = json.loads((DASHBOARDS / "grafana-narwhal.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    model = variables["model"]
    assert model["definition"].startswith("label_values(narwhal_requests_total")
    assert model["definition"].endswith(", model)")
    # All must take the requests refused before their model was known (model="").
    assert model["includeAll"] and model["allValue"] == ".*"
    assert "$model" in variables["engine"]["definition"]
    filtered = 0
    for expr in expressions(dashboard["panels"]):
        for name, _ in selectors(expr):
            if name in REQUEST_SERIES:
                assert "model" in exported[name], name
        for selector in re.findall(r"(\w+)\{([^}]*)\}", expr):
            if selector[0] in REQUEST_SERIES:
                assert 'model=~"$model"' in selector[1], expr
                filtered += 1
    assert filtered >= len(REQUEST_SERIES)


TENANT_SERIES = (
    "narwhal_tenant_requests_total",
    "narwhal_tenant_refusals_total",
    "narwhal_tenant_queue_wait_seconds_bucket",
)


def test_the_tenant_variable_filters_the_per_tenant_panels(exported: Exported) -> None:
    dashboard = json.loads((DASHBOARDS / "grafana-narwhal.json").read_text())
    tenant = {v["name"]: v for v in dashboard["templating"]["list"]}["tenant"]
    assert tenant["definition"].startswith("label_values(narwhal_tenant_requests_total")
    assert tenant["definition"].endswith(", tenant)")
    assert tenant["includeAll"] and tenant["allValue"] == ".*"
    used = set()
    for expr in expressions(dashboard["panels"]):
        for name, selector in re.findall(r"(\w+)\{([^}]*)\}", expr):
            if name.startswith("narwhal_tenant_"):
                assert "tenant" in exported[name], name
                assert 'tenant=~"$tenant"' in selector, expr
                used.add(name)
    assert used == set(TENANT_SERIES)


def test_the_alert_rules_name_only_exported_metrics(exported: Exported) -> None:
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    alerts = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}
            assert rule["annotations"]["summary"]
            check_expression(rule["expr"], exported)
            alerts[rule["alert"]] = rule["expr"]
    assert "narwhal_engine_state" in alerts["NarwhalEngineEjected"]
    assert "narwhal_ttft_seconds_bucket" in alerts["NarwhalTtftP99OverBudget"]
    assert "narwhal_retry_budget_denials_total" in alerts["NarwhalRetryBudgetExhausted"]


def test_the_checker_catches_a_misspelt_metric_or_label(exported: Exported) -> None:
    with pytest.raises(AssertionError, match="not exported"):
        check_expression("rate(narwhal_request_total[5m])", exported)
    with pytest.raises(AssertionError, match="has no label"):
        check_expression('narwhal_engine_streak{phase="decode"}', exported)
    with pytest.raises(AssertionError, match="unknown labels"):
        check_expression("sum by (cuase) (narwhal_request_errors_total)", exported)
