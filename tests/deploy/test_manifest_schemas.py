"""Every object of every kustomization validates against the Kubernetes API schemas (offline, strict), and the
Prometheus operator's objects, which those schemas do not know, pass the PodMonitor CRD's checks."""
import kubernetes_validate
import pytest

from tests.deploy.crd_checks import pod_monitor_problems
from tests.deploy.manifests import KUSTOMIZATIONS, container, find, rendered

# the oldest Kubernetes these manifests are meant for, and the newest the schemas know
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]
PROMETHEUS_OPERATOR_GROUP = "monitoring.coreos.com/"


def schema_problems(obj, version):
    """None when obj validates strictly (no unknown fields) against that version's schema, else the error."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return str(err).splitlines()[0]
    return None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_objects_validate(name, version):
    objects = rendered(name)
    assert objects, f"{name} renders nothing"
    for obj in objects:
        label = f"{name}: {obj['kind']} {obj['metadata']['name']}"
        if obj["apiVersion"].startswith(PROMETHEUS_OPERATOR_GROUP):
            assert obj["kind"] == "PodMonitor", f"{label}: no check for this Prometheus operator kind"
            assert pod_monitor_problems(obj) == [], label
        else:
            assert schema_problems(obj, version) is None, label


def test_the_base_holds_what_a_deployment_needs():
    objects = rendered("base")
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "PodMonitor", "Service"]


def test_a_broken_deployment_is_rejected():
    objects = rendered("base")
    deployment = find(objects, "Deployment")
    assert schema_problems(deployment, KUBERNETES_VERSIONS[-1]) is None
    container(objects)["livenessProbe"]["periodSecond"] = 30  # misspelt field
    assert "periodSecond" in schema_problems(deployment, KUBERNETES_VERSIONS[-1])
    deployment = find(rendered("base"), "Deployment")
    deployment["spec"]["replicas"] = "two"
    assert schema_problems(deployment, KUBERNETES_VERSIONS[-1]) is not None


def test_a_broken_pod_monitor_is_rejected():
    monitor = find(rendered("base"), "PodMonitor")
    del monitor["spec"]["selector"]
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert pod_monitor_problems(monitor) == ["spec.selector is required",
                                             "spec.podMetricsEndpoints[0].intervall is not an endpoint field"]
