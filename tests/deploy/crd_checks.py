"""Checks of the Prometheus operator's objects, which the Kubernetes API schemas do not cover.

The required fields and the field names are those of the operator's monitoring.coreos.com/v1 PodMonitor CRD, so
a missing selector or a misspelt field is reported as the API server would refuse it."""
from __future__ import annotations

from typing import Any

POD_MONITOR_SPEC_FIELDS = {
    "attachMetadata", "bodySizeLimit", "convertClassicHistogramsToNHCB", "fallbackScrapeProtocol", "jobLabel",
    "keepDroppedTargets", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "namespaceSelector",
    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor", "podMetricsEndpoints", "podTargetLabels",
    "sampleLimit", "scrapeClass", "scrapeClassicHistograms", "scrapeNativeHistograms", "scrapeProtocols", "selector",
    "selectorMechanism", "targetLimit"}
POD_METRICS_ENDPOINT_FIELDS = {
    "authorization", "basicAuth", "bearerTokenSecret", "enableHttp2", "filterRunning", "followRedirects",
    "honorLabels", "honorTimestamps", "interval", "metricRelabelings", "noProxy", "oauth2", "params", "path", "port",
    "portNumber", "proxyConnectHeader", "proxyFromEnvironment", "proxyUrl", "relabelings", "scheme", "scrapeTimeout",
    "targetPort", "tlsConfig", "trackTimestampsStaleness"}
LABEL_SELECTOR_FIELDS = {"matchLabels", "matchExpressions"}


def pod_monitor_problems(obj: dict[str, Any]) -> list[str]:
    """What the PodMonitor CRD would refuse in obj; empty when it is fine."""
    problems = []
    if obj.get("apiVersion") != "monitoring.coreos.com/v1" or obj.get("kind") != "PodMonitor":
        return [f"not a monitoring.coreos.com/v1 PodMonitor: {obj.get('apiVersion')} {obj.get('kind')}"]
    if not obj.get("metadata", {}).get("name"):
        problems.append("metadata.name is required")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return problems + ["spec is required"]
    problems += [f"spec.{key} is not a PodMonitor field" for key in sorted(set(spec) - POD_MONITOR_SPEC_FIELDS)]
    selector = spec.get("selector")
    if not isinstance(selector, dict):
        problems.append("spec.selector is required")
    else:
        problems += [f"spec.selector.{key} is not a label selector field"
                     for key in sorted(set(selector) - LABEL_SELECTOR_FIELDS)]
    endpoints = spec.get("podMetricsEndpoints", [])
    if not isinstance(endpoints, list):
        return problems + ["spec.podMetricsEndpoints must be a list"]
    for index, endpoint in enumerate(endpoints):
        problems += [f"spec.podMetricsEndpoints[{index}].{key} is not an endpoint field"
                     for key in sorted(set(endpoint) - POD_METRICS_ENDPOINT_FIELDS)]
        if "port" in endpoint and not isinstance(endpoint["port"], str):
            problems.append(f"spec.podMetricsEndpoints[{index}].port must be a port name")
    return problems
