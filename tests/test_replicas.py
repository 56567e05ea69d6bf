"""``rlt-hal serve --replicas N`` on Ray Serve: two CPU replicas of the tiny checkpoint behind one
loopback endpoint, driven by the official openai client (make test-ray, a venv with the ray
extra). Without Ray installed, the tests of the command line still run: ``--replicas`` says
what to install."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server.args import split_options
from tests.helpers import rlt_hal
from tests.server_helpers import ServerProcess, free_port

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra (make test-ray)")
HEADER = "x-rlt-hal-replica"
REPLICA_PROCESS = "ServeReplica:rlt-hal"  # Ray's process title for our replicas
CONFIG = Path(__file__).parents[1] / "examples" / "ray-serve" / "config.yaml"
# No usage report from a test cluster; no token to set up for a loopback one.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5"]
# Ray's own pydantic models warn on import under pydantic 2.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")


@pytest.mark.skipif(HAS_RAY, reason="ray is installed here")
def test_replicas_without_ray_say_what_to_install(tiny_ckpt):
    proc = rlt_hal("serve", "--model", str(tiny_ckpt), "--replicas", "2", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'rlt-hal[ray]'" in proc.stderr and "Traceback" not in proc.stderr


def test_ray_options_without_replicas_are_refused(tiny_ckpt):
    proc = rlt_hal("serve", "--model", str(tiny_ckpt), "--ray-address", "auto")
    assert proc.returncode == 2
    assert "--ray-address: Ray options, for serve --replicas N only" in proc.stderr, proc.stderr


@needs_ray
def test_serve_without_replicas_never_imports_ray():
    code = (
        "import sys, runtime_glue.cli.main as c, runtime_glue.server.app;"
        "c.build_parser().parse_args(['serve']);"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'ray'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- how a replica is placed: no cluster needed --------------------------------------------


@needs_ray
def test_each_replica_asks_for_one_device_of_its_kind(monkeypatch):
    from runtime_glue.server.replicas import actor_options, device_kind

    monkeypatch.delenv("VLLM_RLT_DEVICE", raising=False)
    assert device_kind(None, {"CPU": 192, "NPU": 8}) == "npu"
    assert device_kind("auto", {"CPU": 64, "GPU": 8}) == "cuda"
    assert device_kind(None, {"CPU": 2}) == "cpu"
    assert device_kind("cuda", {"CPU": 2, "NPU": 8}) == "cuda"
    monkeypatch.setenv("VLLM_RLT_DEVICE", "npu")
    assert device_kind(None, {}) == "npu"
    with pytest.raises(ValueError, match="--device npu"):
        device_kind("npu:3", {"NPU": 8})
    assert actor_options("npu", 4) == {"num_cpus": 4, "resources": {"NPU": 1}}
    assert actor_options("cuda", 2) == {"num_cpus": 2, "num_gpus": 1}
    assert actor_options("cpu", 1) == {"num_cpus": 1}


@needs_ray
def test_replicas_the_cluster_cannot_place_fail_at_once():
    from runtime_glue.server.replicas import check_capacity

    check_capacity("npu", 8, 4, {"CPU": 192, "NPU": 8})
    with pytest.raises(RuntimeError, match="need 8 NPU but the Ray cluster has 2.*set_env.sh"):
        check_capacity("npu", 8, 1, {"CPU": 192, "NPU": 2})
    with pytest.raises(RuntimeError, match="need 4 CPU but the Ray cluster has 2"):
        check_capacity("cpu", 2, 2, {"CPU": 2})


@needs_ray
def test_a_port_in_use_is_refused_before_ray_starts(tiny_ckpt):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = rlt_hal("serve", "--model", str(tiny_ckpt), "--replicas", "1", "--port", str(port),
                       env={**os.environ, **RAY_ENV})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"rlt-hal: error: --port {port}: 127.0.0.1:{port} is already in use (another "
        "server?); stop it or choose another --port"
    )
    assert "Traceback" not in proc.stderr and "Ray instance" not in proc.stderr  # none started


@needs_ray
def test_the_serve_config_example_is_valid_for_ray_and_for_rlt_hal():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from runtime_glue.server import replicas

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    module, _, attr = app.import_path.partition(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is replicas.build_application
    args = dict(app.args)
    engine, options = split_options(args)
    assert engine.model == args["model"] and options.replicas == args["replicas"]
    with pytest.raises(ValueError, match="unknown rlt-hal serve option"):
        split_options({"max_num_seq": 4})


# -- two replicas on loopback ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_ckpt):
    metrics_port = free_port()
    server = ServerProcess(
        tiny_ckpt,
        *("--replicas", "2", "--device", "cpu", "--ray-metrics-export-port", str(metrics_port)),
        env=RAY_ENV,
    )
    server.ray_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        # /health answers once one replica is up; wait for the second.
        server.seen = _replicas_answering(server, want=2, timeout=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base + "/v1", api_key="unused", max_retries=0)


def _replicas_answering(server, want: int, timeout: float) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        reply = httpx.get(server.base + "/health", timeout=10)
        if reply.status_code == 200:
            seen.add(reply.headers[HEADER])
        time.sleep(0.05)
    assert len(seen) >= want, f"{seen} answered within {timeout} s\n{server.output()[-3000:]}"
    return seen


@needs_ray
def test_greedy_completions_and_streams_through_ray_equal_llm_generate(tiny_ckpt, client):
    local = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [out.text for out in local.generate(PROMPTS, params)]
    extra = {"extra_body": {"ignore_eos": True}, "temperature": 0, "max_tokens": 8}
    got = [client.completions.create(model="toy", prompt=p, **extra) for p in PROMPTS]
    assert [c.choices[0].text for c in got] == want
    streamed = [
        "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(model="toy", prompt=p, stream=True, **extra)
            if chunk.choices
        )
        for p in PROMPTS
    ]
    assert streamed == want
    messages = [{"role": "user", "content": "hi"}]
    [answer] = local.chat(messages, params)
    chat = client.chat.completions.create(model="toy", messages=messages, stream=True, **extra)
    pieces = [c.choices[0].delta.content for c in chat if c.choices and c.choices[0].delta.content]
    assert pieces and "".join(pieces) == answer.outputs[0].text


@needs_ray
def test_the_models_route_answers_through_ray(client):
    assert [m.id for m in client.models.list()] == ["toy"]


@needs_ray
def test_requests_are_spread_over_both_replicas_and_each_counts_its_own(cluster):
    names: list[str] = []

    def one(i: int) -> None:
        reply = httpx.post(
            cluster.base + "/v1/completions",
            json={"model": "toy", "prompt": f"request {i}", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        names.append(reply.headers[HEADER])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(names) == 16 and set(names) == cluster.seen
    # Each replica's /metrics is its own engine's: fetched until both have answered, their
    # request counts add up to at least the requests each answered here.
    own: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + 60
    while set(own) != cluster.seen and time.monotonic() < deadline:
        reply = httpx.get(cluster.base + "/metrics", timeout=10)
        own.update(_by_replica(reply.text, "", reply.headers[HEADER]))
    assert set(own) == cluster.seen
    for name in cluster.seen:
        assert own[name]["requests"] >= names.count(name)
        assert own[name]["ttft"] == own[name]["requests"]  # every request here made a token
    # The same figures reach Prometheus through Ray's metrics port, one series per replica.
    mirrored: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + 60
    while mirrored != own and time.monotonic() < deadline:
        time.sleep(1.0)
        mirrored = _by_replica(httpx.get(cluster.ray_metrics, timeout=10).text, "ray_")
    assert mirrored == own


def _by_replica(text: str, prefix: str, replica: str | None = None):
    """{replica: {"requests": ended requests, "ttft": first tokens timed}} from a metrics page;
    ``replica`` names the page's replica when its series carry no ``replica`` label."""
    wanted = {
        f"{prefix}rlt_hal_requests_total": "requests",
        f"{prefix}rlt_hal_time_to_first_token_seconds_count": "ttft",
    }
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                figures = out.setdefault(replica or sample.labels["replica"], {})
                key = wanted[sample.name]
                figures[key] = figures.get(key, 0.0) + sample.value
    return out


def _replica_processes(server):
    """The replica processes under this server (Ray's workers are its descendants)."""
    import psutil

    return [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if REPLICA_PROCESS in " ".join(p.cmdline())
    ]


@needs_ray
def test_a_killed_replica_is_restarted_and_the_endpoint_keeps_serving(cluster, client, capsys):
    victims = _replica_processes(cluster)
    assert len(victims) == 2, victims
    before = set(cluster.seen)
    stop, lock = threading.Event(), threading.Lock()
    served: list[str] = []
    errors: list[str] = []

    def load() -> None:  # four clients, one request after another, until told to stop
        while not stop.is_set():
            try:
                reply = httpx.post(
                    cluster.base + "/v1/completions",
                    json={"model": "toy", "prompt": "keep going", "max_tokens": 8},
                    timeout=60,
                )
            except httpx.HTTPError as exc:
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                if reply.status_code == 200:
                    served.append(reply.headers[HEADER])
                else:
                    errors.append(f"{reply.status_code} {reply.text[:200]}")

    clients = [threading.Thread(target=load) for _ in range(4)]
    for t in clients:
        t.start()
    time.sleep(1.0)
    victims[0].kill()
    killed_at = len(served)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (set(served[killed_at:]) - before):
        time.sleep(0.2)
    time.sleep(1.0)  # the new replica takes its share
    stop.set()
    for t in clients:
        t.join(70)
    newcomers = set(served[killed_at:]) - before
    with capsys.disabled():  # reported in every run, passed or not
        print(f"\nreplica killed mid-run: {len(served)} served, {len(errors)} client errors")
    assert newcomers, f"no replacement replica answered within 120 s; errors: {errors[:5]}"
    # Only what was in flight on the killed replica may fail: at most one per client.
    assert len(errors) <= len(clients), errors
    assert not any(t.is_alive() for t in clients)
    assert client.completions.create(model="toy", prompt="after", max_tokens=2).choices


@needs_ray
def test_the_server_shuts_down_cleanly_with_its_replicas(cluster):
    import psutil

    replicas = _replica_processes(cluster)
    assert len(replicas) == 2
    assert cluster.stop(signal.SIGTERM) == 0, cluster.output()[-3000:]
    _, alive = psutil.wait_procs(replicas, timeout=10)
    assert not alive, "replica processes outlived the server"


@needs_ray
def test_serve_run_deploys_the_config_example(tiny_ckpt, tmp_path):
    """`serve run config.yaml` (Ray's own CLI) with the example's import path and args, the
    model and device made this machine's."""
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    del args["kv_cache_memory"]
    args.update(model=str(tiny_ckpt), device="cpu", replicas=1, cpus_per_replica=1)
    args.update(block_size=16, num_blocks=64)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).with_name("serve")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(serve_cli), "run", "config.yaml"],
            cwd=tmp_path,
            env={**os.environ, **RAY_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches its whole group, as in a terminal
        )
    try:
        reply, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = httpx.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": args["served_model_name"], "prompt": "hi", "max_tokens": 3},
                    timeout=30,
                )
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert reply is not None and reply.status_code == 200, log.read_text()[-3000:]
        assert reply.headers[HEADER] and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@needs_ray
def test_a_joined_cluster_keeps_running_when_the_command_stops(tiny_ckpt):
    """--ray-address: the command deploys onto a cluster `ray start` began, and on exit deletes
    its application only."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port, env = free_port(), {**os.environ, **RAY_ENV}
    head = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}"]
    head += ["--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"]
    started = subprocess.run(head, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    address = f"127.0.0.1:{port}"
    try:
        server = ServerProcess(
            tiny_ckpt, "--replicas", "1", "--device", "cpu", "--ray-address", address, env=RAY_ENV
        )
        try:
            reply = httpx.post(
                server.base + "/v1/completions",
                json={"model": "toy", "prompt": "hi", "max_tokens": 3},
                timeout=60,
            )
            assert reply.status_code == 200 and reply.headers[HEADER]
        finally:
            assert server.stop(signal.SIGTERM) == 0, server.output()[-3000:]
        status = subprocess.run(
            [ray_cli, "status", f"--address={address}"], env=env, capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr  # the cluster outlived the command
        # Serve's proxy still answers on the port, but the rlt-hal application is gone.
        assert httpx.get(server.base + "/health", timeout=10).status_code == 404
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
