"""The deployment files hold together: compose wiring and every Kubernetes manifest against the API schemas.

No Docker engine or cluster runs here, so the files are parsed and checked offline.
"""

import glob
import os
import re

import pytest
import yaml

from expertd.server.config import config_from_dict

DOCKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docker")
ROOT = os.path.dirname(DOCKER)
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0")


def load(path: str):
    with open(path) as f:
        return yaml.safe_load(f)


def test_compose_daemon_is_healthchecked_and_shares_ipc_with_the_worker():
    compose = load(os.path.join(DOCKER, "docker-compose.yml"))
    daemon, worker = compose["services"]["expertd"], compose["services"]["worker"]
    assert daemon["ipc"] == "shareable" and worker["ipc"] == "service:expertd"
    assert re.match(r"^\d+[kmg]b?$", str(daemon["shm_size"]))
    assert daemon["restart"] in ("always", "unless-stopped") and worker["restart"]
    test = daemon["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:4] == ["expertd", "status", "--config"] and "--wait" in test
    assert daemon["healthcheck"]["start_period"]
    assert worker["depends_on"]["expertd"]["condition"] == "service_healthy"
    # the socket folder is one volume in both, and the worker's endpoint is the daemon's
    run = [v for v in daemon["volumes"] if v.startswith("expertd-run:")]
    assert run and run[0] in worker["volumes"] and "expertd-run" in compose["volumes"]
    mounted = run[0].split(":")[1]
    cfg_mount = next(v for v in daemon["volumes"] if v.endswith(":/etc/expertd/expertd.yaml:ro"))
    cfg = load(os.path.join(DOCKER, cfg_mount.split(":")[0]))
    assert cfg["endpoint"] == worker["environment"]["EXPERTD_ENDPOINT"] == f"ipc://{mounted}/expertd.sock"
    assert any(v.endswith(":" + cfg["checkpoint"] + ":ro") for v in daemon["volumes"])
    config_from_dict(cfg)  # a config the daemon accepts


def test_compose_gpu_variant_and_images():
    gpu = load(os.path.join(DOCKER, "docker-compose.gpu.yml"))
    assert gpu["services"]["expertd"]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    devices = gpu["services"]["expertd"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        cpu = f.read()
    with open(os.path.join(DOCKER, "Dockerfile.gpu")) as f:
        cuda = f.read()
    assert "download.pytorch.org/whl/cpu" in cpu and re.search(r"\bgcc\b|build-essential", cpu)
    assert re.search(r"^FROM .*(nvidia/cuda|CUDA_IMAGE)", cuda, re.M) and "whl/cu" in cuda
    for text in (cpu, cuda):
        assert "HEALTHCHECK" in text and "--wait" in text and '".[server]"' in text
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = f.read().split()
    assert {".git", "**/__pycache__"} <= set(ignored)


def kubernetes_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(glob.glob(os.path.join(DOCKER, "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return docs


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_against_the_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = kubernetes_documents()
    assert {d["kind"] for _, d in docs} >= {"DaemonSet", "Deployment", "ConfigMap"}
    for name, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_kubernetes_daemonset_and_workers_share_socket_and_shm():
    docs = {d["kind"]: d for _, d in kubernetes_documents()}
    ds, worker, cm = docs["DaemonSet"]["spec"]["template"]["spec"], docs["Deployment"]["spec"]["template"]["spec"], docs["ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["expertd.yaml"])
    config_from_dict(cfg)
    assert ds["hostIPC"] is True and worker["hostIPC"] is True
    daemon = ds["containers"][0]
    probe = daemon["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["expertd", "status"] and "--wait" in probe
    assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"]
    socket_folder = os.path.dirname(cfg["endpoint"][len("ipc://"):])
    host_run = {v["name"]: v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v}
    worker_run = {v["name"]: v["hostPath"]["path"] for v in worker["volumes"] if "hostPath" in v}
    mount = next(m for m in daemon["volumeMounts"] if m["mountPath"] == socket_folder)
    assert host_run[mount["name"]] in worker_run.values()
    checkpoint = next(m for m in daemon["volumeMounts"] if m["mountPath"] == cfg["checkpoint"])
    assert checkpoint["readOnly"] is True
    config_volume = next(v for v in ds["volumes"] if "configMap" in v)
    assert config_volume["configMap"]["name"] == cm["metadata"]["name"]
    env = {e["name"]: e["value"] for e in worker["containers"][0]["env"]}
    assert env["EXPERTD_ENDPOINT"] == cfg["endpoint"]
    wait = worker["initContainers"][0]["command"]
    assert wait[:2] == ["expertd", "status"] and "--wait" in wait and cfg["endpoint"] in wait
    assert daemon["ports"][0]["containerPort"] == cfg["metrics_port"]


def test_compose_hugepages_override_shares_one_huge_tmpfs_at_the_configs_shm_dir():
    override = load(os.path.join(DOCKER, "docker-compose.hugepages.yml"))
    daemon, worker = override["services"]["expertd"], override["services"]["worker"]
    volume = override["volumes"]["expertd-hugeshm"]
    assert volume["driver"] == "local" and volume["driver_opts"]["type"] == "tmpfs"
    assert "huge=always" in volume["driver_opts"]["o"].split(",")
    shm = [v for v in daemon["volumes"] if v.startswith("expertd-hugeshm:")]
    assert shm and shm[0] in worker["volumes"]  # one tmpfs, at the same path in both containers
    cfg_mount = next(v for v in daemon["volumes"] if v.endswith(":/etc/expertd/expertd.yaml:ro"))
    cfg = load(os.path.join(DOCKER, cfg_mount.split(":")[0]))
    assert cfg["shm_dir"] == shm[0].split(":")[1]
    base = load(os.path.join(DOCKER, "expertd.yaml"))
    assert {k: v for k, v in cfg.items() if k != "shm_dir"} == base
