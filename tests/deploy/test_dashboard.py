"""The Grafana dashboard loads as an importable dashboard, shows what the issue asks for, and every query reads
only series the server exports."""
import copy
import json

import pytest

from tests.deploy.exported_series import exported_series
from tests.deploy.manifests import KUBERNETES_DIR, find, rendered
from tests.deploy.promql_names import metric_names, template_query_names

DASHBOARD_PATH = KUBERNETES_DIR / "grafana" / "tandem-dashboard.json"
HISTOGRAMS = ("tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
              "tandem_request_latency_seconds")


def load_dashboard():
    return json.loads(DASHBOARD_PATH.read_text())


def panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(dashboard):
    """(where, PromQL) for every panel target and template variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["query"]["query"]


def unexported_series(dashboard, exported):
    """The queries that read a series the server does not export, or none at all."""
    problems = []
    for where, expr in queries(dashboard):
        names = template_query_names(expr) if where.startswith("variable") else metric_names(expr)
        if not names or names - exported:
            problems.append(f"{where}: {sorted(names - exported) or 'no series'}")
    return problems


def test_dashboard_is_importable():
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard  # an exported id would clash with the importing Grafana's own
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_query_reads_exported_series():
    assert unexported_series(load_dashboard(), exported_series()) == []


def test_a_query_of_a_series_the_server_lacks_is_caught():
    dashboard = load_dashboard()
    broken = copy.deepcopy(dashboard)
    target = next(p for p in panels(broken) if p["type"] != "row")["targets"][0]
    target["expr"] = target["expr"].replace("tandem_requests_total", "tandem_request_total")
    assert len(unexported_series(broken, exported_series())) == 1
    broken = copy.deepcopy(dashboard)
    broken["templating"]["list"][1]["query"]["query"] = "label_values(nv_inference_count, namespace)"
    assert unexported_series(broken, exported_series()) == ["variable namespace: ['nv_inference_count']"]


def test_every_tandem_series_is_on_the_dashboard():
    shown = set().union(*(metric_names(expr) for _, expr in queries(load_dashboard())))
    tandem = {name for name in exported_series() if name.startswith("tandem_")}
    assert tandem - shown == set()


@pytest.mark.parametrize("histogram", HISTOGRAMS)
def test_latency_percentiles_come_from_the_histograms(histogram):
    exprs = [expr for _, expr in queries(load_dashboard()) if f"{histogram}_bucket" in expr]
    quantiles = sorted(expr.split(",")[0] for expr in exprs)
    assert quantiles == ["histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.99"]
    for expr in exprs:
        assert "sum by (le) (rate(" in expr, expr  # per-bucket rates summed over pods, le kept


def test_panels_cover_the_serving_questions():
    titles = {panel["title"] for panel in panels(load_dashboard())}
    assert {"Request rate by finish reason", "Time to first token", "Inter-token latency",
            "End-to-end request latency", "Tokens / s", "Running requests by pod", "Waiting requests by pod",
            "KV cache usage by pod", "GPU busy by pod", "Preemptions / s by pod", "Errors by code"} <= titles


def test_the_grafana_config_map_carries_the_dashboard():
    config_map = find(rendered("grafana"), "ConfigMap", "tandem-grafana-dashboard")
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(config_map["data"][DASHBOARD_PATH.name]) == load_dashboard()


def test_errors_panel_counts_error_responses_by_code():
    """The errors panel reads the counter of error responses (every code, refusals at admission included), not
    the finish reasons, which miss requests refused before they reach the engine."""
    panel = next(p for p in panels(load_dashboard()) if p["title"] == "Errors by code")
    exprs = [target["expr"] for target in panel["targets"]]
    assert [metric_names(expr) for expr in exprs] == [{"tandem_request_errors_total"}]
    assert exprs[0].startswith("sum by (code) (rate(tandem_request_errors_total{"), exprs[0]
    assert panel["targets"][0]["legendFormat"] == "{{code}}"
