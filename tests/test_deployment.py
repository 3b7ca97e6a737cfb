"""The deployment files hold together: compose wiring and every Kubernetes manifest against the API schemas.

No Docker engine or cluster runs here, so the files are parsed and checked offline.
"""

import contextlib
import glob
import grp
import os
import re
import tempfile

import pytest
import yaml

from expertd.server.daemon.config import config_from_dict

DOCKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docker")
ROOT = os.path.dirname(DOCKER)
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0")


def load(path: str):
    with open(path) as f:
        return yaml.safe_load(f)


def accepted(cfg: dict):
    """The config as the daemon would take it; its `group` (made by the image, absent here) stands for one of ours."""
    return config_from_dict({**cfg, "group": grp.getgrgid(os.getgid()).gr_name} if cfg.get("group") else cfg)


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
    accepted(cfg)  # a config the daemon accepts


def test_compose_gpu_derived_and_images():
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


def kubernetes_documents(folder: str = "kubernetes") -> list[tuple[str, dict]]:
    """The API objects of a manifest folder (kustomization.yaml is kustomize's, not the API's)."""
    docs = []
    for path in sorted(glob.glob(os.path.join(DOCKER, folder, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return docs


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_against_the_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = kubernetes_documents()
    assert {d["kind"] for _, d in docs} >= {"DaemonSet", "Deployment", "ConfigMap"}
    multinode = kubernetes_documents("kubernetes/multinode")
    assert {d["kind"] for _, d in multinode} >= {"DaemonSet", "Secret", "ServiceAccount", "ClusterRole",
                                                 "ClusterRoleBinding"}
    for name, doc in docs + multinode:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


@pytest.mark.parametrize("folder", ["kubernetes", "kubernetes/multinode"])
def test_kustomization_lists_every_manifest_and_names_the_image(folder):
    """Every container runs the `expertd` image that kustomization.yaml points at a registry (a local tag
    like `expertd:cpu` is nothing a node can pull), and every manifest of the folder is a resource."""
    kustomization = load(os.path.join(DOCKER, folder, "kustomization.yaml"))
    files = {os.path.basename(p) for p in glob.glob(os.path.join(DOCKER, folder, "*.yaml"))} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    (image,) = kustomization["images"]
    assert image["name"] == "expertd" and "/" in image["newName"] and image["newTag"]
    docs = kubernetes_documents(folder)
    assert {c["image"] for _, d in docs for c in containers(d)} == {"expertd"}


def test_kubernetes_daemonset_and_workers_share_socket_and_shm():
    docs = {d["kind"]: d for _, d in kubernetes_documents()}
    ds, worker = docs["DaemonSet"]["spec"]["template"]["spec"], docs["Deployment"]["spec"]["template"]["spec"]
    cm = docs["ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["expertd.yaml"])
    accepted(cfg)
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
    # the example serves the tiny checkpoint the image holds (docker/Dockerfile copies checkpoints/tiny), sized so
    assert cfg["checkpoint"] == "/opt/expertd/checkpoints/tiny"
    assert not any(m["mountPath"] == cfg["checkpoint"] for m in daemon["volumeMounts"])
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        assert "WORKDIR /opt/expertd" in f.read()
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        assert "!checkpoints/tiny" in f.read().split()
    config_volume = next(v for v in ds["volumes"] if "configMap" in v)
    assert config_volume["configMap"]["name"] == cm["metadata"]["name"]
    env = {e["name"]: e["value"] for e in worker["containers"][0]["env"]}
    assert env["EXPERTD_ENDPOINT"] == cfg["endpoint"]
    wait = worker["initContainers"][0]["command"]
    assert wait[:2] == ["expertd", "status"] and "--wait" in wait and cfg["endpoint"] in wait
    # the worker stays up (a worker that exits would crash-loop the Deployment) and says when it is ready
    serve = worker["containers"][0]
    assert serve["command"][:2] == ["python", "examples/serve.py"]
    assert os.path.exists(os.path.join(ROOT, serve["command"][1]))
    assert serve["readinessProbe"]["httpGet"]["path"] == "/healthz"
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


def test_multinode_daemons_take_their_ranks_from_the_node_label(tmp_path):
    """Each node's daemon serves the EP ranks of its node's `expertd.io/ep-ranks` label: an init container
    writes the label (read with the pod's service account, which may get nodes) to a file the daemon reads
    with --ep-ranks @FILE; the workers take their torchrun node rank from the same label and reach their
    node's daemon on the host network over CURVE, with the daemon's public key from the keys' Secret, which
    also puts the trainer's key on the daemon's push allow-list."""
    from expertd.security import create_keys
    from expertd.server.cli.starting import ep_ranks_override

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in kubernetes_documents("kubernetes/multinode")}
    secret = docs[("Secret", "expertd-ep-config")]["stringData"]
    raw = yaml.safe_load(secret["expertd.yaml"])
    daemon, workers = docs[("DaemonSet", "expertd-ep")], docs[("DaemonSet", "expertd-ep-workers")]
    # the key files the daemon's Secret volume provides, at the paths the config names
    keys = next(v for v in daemon["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys")["secret"]
    mount = next(m for m in daemon["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] if m["name"] == "keys")
    paths = {os.path.join(mount["mountPath"], item["path"]): item["key"] for item in keys["items"]}
    assert paths[raw["curve_secret_key"]] == "daemon.key_secret"
    assert os.path.dirname(next(p for p, k in paths.items() if k == "trainer.key")) == raw["curve_push_keys"]
    local = tmp_path / "keys"  # the same layout with real keys, so the config is checked as the daemon would
    create_keys(str(local), "daemon")
    create_keys(str(local / "push"), "trainer")
    cfg = accepted({**raw, "curve_secret_key": str(local / "daemon.key_secret"),
                            "curve_push_keys": str(local / "push")})
    assert cfg.expert_parallel is not None and cfg.endpoint.startswith("tcp://0.0.0.0:") and not cfg.insecure_tcp
    compile(secret["node-ranks.py"], "node-ranks.py", "exec")
    role = docs[("ClusterRole", "expertd-ep-read-nodes")]["rules"]
    assert role == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    for ds in (daemon, workers):
        spec = ds["spec"]["template"]["spec"]
        assert spec["hostIPC"] is True and spec["hostNetwork"] is True and spec["serviceAccountName"] == "expertd-ep"
        term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == [{"matchExpressions": [{"key": "expertd.io/ep-ranks", "operator": "Exists"}]}]
        init = spec["initContainers"][0]
        assert init["command"][:2] == ["python", "/etc/expertd/node-ranks.py"]
        assert init["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    args = daemon["spec"]["template"]["spec"]["containers"][0]["args"]
    ranks_file = daemon["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert args[args.index("--ep-ranks") + 1] == "@" + ranks_file
    for label, ranks in (("1", [1]), ("0-1", [0, 1]), ("0.1", [0, 1])):
        with _ranks_file(label) as path:
            assert list(ep_ranks_override(cfg, "@" + path).ranks) == ranks
    spec = workers["spec"]["template"]["spec"]
    worker = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["EXPERTD_ENDPOINT"] == f"tcp://127.0.0.1:{cfg.endpoint.rsplit(':', 1)[1]}"
    worker_keys = next(v for v in spec["volumes"] if v["name"] == "keys")["secret"]
    worker_mount = next(m for m in worker["volumeMounts"] if m["name"] == "keys")
    assert worker_keys["secretName"] == keys["secretName"]
    assert worker_keys["items"] == [{"key": "daemon.key", "path": "daemon.key"}]
    assert env["EXPERTD_SERVER_KEY"] == os.path.join(worker_mount["mountPath"], "daemon.key")
    wait = spec["initContainers"][1]["command"]
    assert wait[:2] == ["expertd", "status"] and wait[wait.index("--server-key") + 1] == env["EXPERTD_SERVER_KEY"]
    assert "torchrun" in worker["args"][0] and "examples/ep_worker.py" in worker["args"][0]
    assert os.path.exists(os.path.join(ROOT, "examples", "ep_worker.py"))


@contextlib.contextmanager
def _ranks_file(text: str):
    with tempfile.NamedTemporaryFile("w", suffix=".ranks") as f:
        f.write(text)
        f.flush()
        yield f.name


def image_users() -> dict:
    """The users and groups docker/Dockerfile makes, which both images must make alike: {name: uid or gid}, the
    worker's extra groups, the owner and mode of the socket folder, and the image's USER."""
    found = []
    for name in ("Dockerfile", "Dockerfile.gpu"):
        with open(os.path.join(DOCKER, name)) as f:
            text = f.read()
        groups = dict((n, int(g)) for g, n in re.findall(r"groupadd --gid (\d+) (\S+)", text))
        users = {n: (int(u), g, extra) for u, g, extra, n in
                 re.findall(r"useradd --uid (\d+) --gid (\S+)(?: --groups (\S+))?.*?(?:\\\n.*?)?"
                            r"--shell \S+ (\S+)", text)}
        folder = re.search(r"install -d -o (\S+) -g (\S+) -m (\d+) /run/expertd", text)
        found.append({"groups": groups, "users": users, "run": folder.groups(),
                      "USER": re.findall(r"^USER (\S+)", text, re.M)})
    assert found[0] == found[1]
    return found[0]


def test_daemon_and_workers_run_as_two_uids_sharing_the_daemons_group():
    """Least privilege: the daemon's uid alone writes segments; workers run as another uid in the daemon's group,
    which `group:` in every shipped config gives read access (segments 0640, socket 0660) and nothing more.
    tests/attacks/test_group_mode.py runs this set-up with two uids on the host and performs the attacks."""
    image = image_users()
    gid = image["groups"]["expertd"]
    daemon_uid, daemon_group, _ = image["users"]["expertd"]
    worker_uid, worker_group, worker_extra = image["users"]["expertd-worker"]
    assert daemon_group == "expertd" and worker_group != "expertd" and worker_extra == "expertd"
    assert daemon_uid != worker_uid and image["groups"][worker_group] != gid
    assert image["run"] == ("expertd", "expertd", "0750") and image["USER"] == ["expertd"]
    # compose: the daemon as expertd, the worker as expertd-worker with the daemon's group added
    compose = load(os.path.join(DOCKER, "docker-compose.yml"))
    daemon, worker = compose["services"]["expertd"], compose["services"]["worker"]
    assert daemon["user"] == f"{daemon_uid}:{gid}" and "group_add" not in daemon
    assert worker["user"] == f"{worker_uid}:{image['groups'][worker_group]}" and worker["group_add"] == [str(gid)]
    for service in (daemon, worker):
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in service["security_opt"] and "/tmp" in service["tmpfs"]
    for name in ("expertd.yaml", "expertd-hugepages.yaml"):
        cfg = load(os.path.join(DOCKER, name))
        assert cfg["group"] == "expertd", name
    accepted(load(os.path.join(DOCKER, "expertd.yaml")))
    huge = load(os.path.join(DOCKER, "docker-compose.hugepages.yml"))["volumes"]["expertd-hugeshm"]["driver_opts"]["o"]
    assert {f"uid={daemon_uid}", f"gid={gid}", "mode=0750"} <= set(huge.split(","))
    # Kubernetes, one node and several: the same uids and group, from the pods' security contexts
    for folder, config_of in (("kubernetes", lambda d: d["ConfigMap"]["data"]["expertd.yaml"]),
                              ("kubernetes/multinode", lambda d: d["Secret"]["stringData"]["expertd.yaml"])):
        docs = {d["kind"]: d for _, d in kubernetes_documents(folder)}
        assert yaml.safe_load(config_of(docs))["group"] == "expertd"
        pods = [d for _, d in kubernetes_documents(folder) if d["kind"] in ("DaemonSet", "Deployment")]
        daemons = [d for d in pods if any(c["name"] == "expertd" for c in containers(d))]
        workers = [d for d in pods if d not in daemons]
        assert len(daemons) == 1 and len(workers) == 1, folder
        pod = daemons[0]["spec"]["template"]["spec"]["securityContext"]
        assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"], pod["runAsNonRoot"]) == \
            (daemon_uid, gid, gid, True)
        pod = workers[0]["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsUser"] == worker_uid != daemon_uid and pod["runAsGroup"] != gid and pod["runAsNonRoot"] is True
        assert pod["supplementalGroups"] == [gid]
        for doc in pods:
            for c in containers(doc):
                ctx = c["securityContext"]
                assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True, c["name"]
                assert ctx["capabilities"]["drop"] == ["ALL"], c["name"]
                if c["name"] == "run-folder":  # root only to hand the hostPath socket folder to the daemon
                    assert ctx["runAsUser"] == 0 and sorted(ctx["capabilities"]["add"]) == ["CHOWN", "FOWNER"]
                    assert c["command"][-1] == f"chmod 0750 /run/expertd && chown {daemon_uid}:{gid} /run/expertd"
                else:
                    assert "add" not in ctx["capabilities"] and "runAsUser" not in ctx, c["name"]
            spec = doc["spec"]["template"]["spec"]
            tmp = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
            assert any(m["mountPath"] == "/tmp" and m["name"] in tmp
                       for c in spec["containers"] for m in c["volumeMounts"])
