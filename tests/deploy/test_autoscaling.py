"""The autoscaler's metrics reach it: the PodMonitor scrapes every replica's metrics port, the Prometheus adapter's
rules turn exported series into per-pod metrics, and the HorizontalPodAutoscaler of every overlay asks for those."""
import re

import pytest
import yaml

from tests.deploy.exported_series import exported_series
from tests.deploy.manifests import SERVING_KUSTOMIZATIONS, container, find, rendered
from tests.deploy.promql_names import metric_names

TEMPLATE_FIELDS = ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>")


def adapter_rules():
    config_map = find(rendered("prometheus-adapter"), "ConfigMap", "tandem-prometheus-adapter-rules")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def served_metrics(rules, exported):
    """The custom metrics the adapter serves per pod, from rules that read exported series; ValueError otherwise."""
    served = set()
    for rule in rules:
        names = metric_names(rule["seriesQuery"])
        if not names or names - exported:
            raise ValueError(f"seriesQuery {rule['seriesQuery']!r} reads series the server does not export")
        if rule["resources"].get("overrides") != {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}:
            raise ValueError(f"rule for {names} does not map the namespace and pod labels to their resources")
        if not all(field in rule["metricsQuery"] for field in TEMPLATE_FIELDS):
            raise ValueError(f"metricsQuery {rule['metricsQuery']!r} lacks one of {TEMPLATE_FIELDS}")
        for name in names:
            if not re.search(rule["name"]["matches"], name):
                raise ValueError(f"name.matches {rule['name']['matches']!r} does not match {name}")
            served.add(re.sub(rule["name"]["matches"], rule["name"].get("as") or r"\g<0>", name))
    return served


def test_adapter_rules_read_exported_series():
    assert served_metrics(adapter_rules(), exported_series()) == {"tandem_num_requests_waiting",
                                                                  "tandem_kv_cache_usage_ratio"}


def test_a_rule_on_a_series_the_server_lacks_is_refused():
    rules = adapter_rules()
    rules[0]["seriesQuery"] = 'tandem_requests_waiting{namespace!="",pod!=""}'
    with pytest.raises(ValueError, match="does not export"):
        served_metrics(rules, exported_series())


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_the_autoscaler_asks_for_metrics_the_adapter_serves(name):
    objects = rendered(name)
    hpa = find(objects, "HorizontalPodAutoscaler")
    deployment = find(objects, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    asked = {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]}
    assert all(metric["type"] == "Pods" for metric in hpa["spec"]["metrics"])
    assert asked == served_metrics(adapter_rules(), exported_series())
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployment["spec"]  # else each apply would reset the autoscaler's count


@pytest.mark.parametrize("name", SERVING_KUSTOMIZATIONS)
def test_the_pod_monitor_and_service_reach_the_pods(name):
    objects = rendered(name)
    pod_labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    ports = {port["name"]: port["containerPort"] for port in container(objects)["ports"]}
    monitor = find(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [ports[endpoint["port"]] for endpoint in monitor["spec"]["podMetricsEndpoints"]] == [8002]
    assert find(objects, "Service")["spec"]["selector"].items() <= pod_labels.items()
    assert find(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
