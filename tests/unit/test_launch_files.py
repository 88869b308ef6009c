"""The cluster launch files are accepted by the tools that run them, and call the launchers with
flags the launchers accept.

- SkyPilot: ``sky.Task.from_yaml`` + ``task.validate()``, offline, in a child process with a
  temporary HOME (SkyPilot writes under ~/.sky) holding a small accelerator catalog.
- Kubernetes: ``kubernetes-validate --strict`` against the API schema it ships, so an unknown
  (misspelt) field fails.
- Both: the command each file runs is executed with ``SPOTLIGHT=echo`` (the launchers' documented
  way to name the spotlight command), and the line it would run is parsed by spotlight's own CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spotlight.cli import parse_args

ROOT = Path(__file__).resolve().parents[2]
SKY, K8S = ROOT / "launch" / "skypilot", ROOT / "launch" / "k8s"
SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"  # SkyPilot's own venv (scripts/setup.sh)
CATALOG = "AcceleratorName,Clouds\n" + "".join(
    f"{a},\"['AWS', 'GCP', 'Azure']\"\n" for a in ("H100", "H200", "A100-80GB", "L40S")
)

SKY_CHECK = """
import json, sys
import sky
out = {}
for path in sys.argv[1:]:
    try:
        task = sky.Task.from_yaml(path)
        task.validate()
    except Exception as e:
        out[path] = {"error": str(e)}
        continue
    out[path] = {"nodes": task.num_nodes, "spot": sorted({r.use_spot for r in task.resources}),
                 "accelerators": sorted(a for r in task.resources for a in r.accelerators),
                 "recovery": [r.job_recovery for r in task.resources]}
print(json.dumps(out))
"""


def _sky(home: Path, *paths: Path) -> subprocess.CompletedProcess:
    catalog = home / ".sky" / "catalogs" / "v8" / "common"
    catalog.mkdir(parents=True, exist_ok=True)
    (catalog / "accelerators.csv").write_text(CATALOG)
    env = {**os.environ, "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    return subprocess.run([str(SKY_PYTHON), "-c", SKY_CHECK, *map(str, paths)], env=env, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.slow
def test_skypilot_accepts_both_tasks(tmp_path):
    if not SKY_PYTHON.exists():
        pytest.skip("no .venv-sky (scripts/setup.sh makes it): SkyPilot lives in a venv of its own")
    reserved, spot = SKY / "reserved.yaml", SKY / "spot.yaml"
    bad = tmp_path / "bad.yaml"  # a misspelt field must fail SkyPilot's own schema check
    bad.write_text(spot.read_text().replace("use_spot:", "use_spott:"))
    done = _sky(tmp_path, reserved, spot, bad)  # one child: importing sky takes seconds
    assert done.returncode == 0, done.stderr[-3000:]
    tasks = json.loads(done.stdout.splitlines()[-1])
    assert "use_spott" in tasks[str(bad)]["error"]
    assert "error" not in tasks[str(reserved)] and "error" not in tasks[str(spot)], tasks
    assert tasks[str(reserved)]["spot"] == [False] and tasks[str(reserved)]["nodes"] == 1
    assert tasks[str(spot)]["spot"] == [True] and tasks[str(spot)]["nodes"] >= 2
    assert len(tasks[str(spot)]["accelerators"]) >= 2  # a choice of accelerators
    assert all(r and r["strategy"] for r in tasks[str(spot)]["recovery"])
    # The keys are secrets given at launch, never values in the file.
    for path, names in ((reserved, {"SPOTLIGHT_CONTROLLER_KEY_SECRET", "SPOTLIGHT_NODE_KEY"}),
                        (spot, {"SPOTLIGHT_NODE_KEY_SECRET", "SPOTLIGHT_CONTROLLER_KEY"})):
        secrets = yaml.safe_load(path.read_text())["secrets"]
        assert set(secrets) == names and all(v is None for v in secrets.values())


def _kube_validate(*paths: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("kubernetes-validate")
    return subprocess.run([str(exe), "--strict", *map(str, paths)], text=True, capture_output=True,
                          timeout=60)


def test_kubernetes_manifests_validate_strictly(tmp_path):
    pytest.importorskip("kubernetes_validate")
    done = _kube_validate(K8S / "reserved.yaml", K8S / "spot.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "spot.yaml").read_text().replace("terminationGracePeriodSeconds:",
                                                           "terminationGracePeriodSecond:"))
    done = _kube_validate(bad)
    assert done.returncode != 0 and "terminationGracePeriodSecond" in done.stdout + done.stderr


def _docs(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}


def _pod(path: Path) -> dict:
    return _docs(path)["Deployment"]["spec"]["template"]["spec"]


def test_kubernetes_pools_ports_and_eviction():
    reserved, spot = _pod(K8S / "reserved.yaml"), _pod(K8S / "spot.yaml")
    spot_labels = {"cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType",
                   "kubernetes.azure.com/scalesetpriority"}
    (term,) = reserved["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {e["key"] for e in term["matchExpressions"] if e["operator"] == "NotIn"} == spot_labels
    terms = spot["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {e["key"] for t in terms for e in t["matchExpressions"] if e["operator"] == "In"} == spot_labels
    assert {t["key"] for t in spot["tolerations"]} == spot_labels
    assert spot["terminationGracePeriodSeconds"] >= 10  # the agent leaves within runtime.leave_s (2 s)
    assert "kill -TERM 1" in " ".join(spot["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
    service = _docs(K8S / "reserved.yaml")["Service"]
    args = reserved["containers"][0]["args"]
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert ports == {int(args[args.index(f)+1]) for f in ("--port", "--queue-port", "--store-port")}
    assert args[args.index("--advertise") + 1] == service["metadata"]["name"]


def _launched(script: str, args: list[str], env: dict[str, str], cwd: Path = ROOT) -> list[str]:
    """The spotlight command line ``script`` runs (SPOTLIGHT=echo prints it instead)."""
    env = {"PATH": os.environ["PATH"], "SPOTLIGHT": "echo", **env}
    done = subprocess.run(["bash", "-c", script, "launcher", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_kubernetes_commands_parse():
    for path, sub in ((K8S / "reserved.yaml", "reserved"), (K8S / "spot.yaml", "agent")):
        container = _pod(path)["containers"][0]
        args = [a.replace("$(POD_NAME)", "spot-abc") for a in container["args"]]
        line = _launched(f'exec {container["command"][0]} "$@"', args, {})
        assert line[0] == sub
        parsed = parse_args(line)
        assert parsed.keys == "/keys"
        if sub == "agent":
            assert parsed.controller == "tcp://spotlight-reserved:5555" and parsed.node_id == "spot-abc"


def test_skypilot_run_scripts_write_keys_and_parse(tmp_path):
    reserved = yaml.safe_load((SKY / "reserved.yaml").read_text())
    env = {**{k: str(v) for k, v in reserved["envs"].items()}, "HOME": str(tmp_path),
           "SPOTLIGHT_CONTROLLER_KEY_SECRET": "secret-pair", "SPOTLIGHT_NODE_KEY": "node-public"}
    line = _launched(reserved["run"], [], env)
    parsed = parse_args(line)
    assert line[0] == "reserved" and (parsed.port, parsed.queue_port, parsed.store_port) == (5555, 5556, 5557)
    keys = Path(parsed.keys)
    assert (keys / "controller.key_secret").read_text().strip() == "secret-pair"
    assert (keys / "nodes" / "spot.key").read_text().strip() == "node-public"
    assert (keys / "controller.key_secret").stat().st_mode & 0o077 == 0
    spot = yaml.safe_load((SKY / "spot.yaml").read_text())
    env = {**{k: str(v) for k, v in spot["envs"].items()}, "HOME": str(tmp_path / "spot"),
           "SPOTLIGHT_CONTROLLER": "tcp://10.0.0.2:5555", "SPOTLIGHT_NODE_KEY_SECRET": "node-pair",
           "SPOTLIGHT_CONTROLLER_KEY": "controller-public", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
           "SKYPILOT_NODE_RANK": "1"}
    line = _launched(spot["run"], [], env)
    parsed = parse_args(line)
    assert line[0] == "agent" and parsed.controller == "tcp://10.0.0.2:5555" and parsed.workers == 8
    assert (Path(parsed.keys) / "node.key_secret").read_text().strip() == "node-pair"
