"""Secrets stay secret, remote code stays off, and nothing is downloaded unless asked.

- AWS (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`) and W&B (`WANDB_API_KEY`) values, set to
  recognisable canary strings, never appear in stdout, stderr, a log line or any file a run writes — including when
  an S3-compatible server echoes the request (session token included) back in its error message.
- `trust_remote_code` reaches transformers as False unless the config asks for it.
- With HF_HUB_OFFLINE unset, an uncached hub id is a clear error at once, and no connection is even attempted.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flashdraft import bundled, cli

CANARIES = {
    "AWS_ACCESS_KEY_ID": "AKIAFDCANARYKEYID000",
    "AWS_SECRET_ACCESS_KEY": "fdCanarySecret/Access+Key0000000000000000",
    "AWS_SESSION_TOKEN": "fdCanarySessionToken0000000000000000000",
    "WANDB_API_KEY": "fdcanarywandbapikey00000000000000000000000",
}
_AWS_OTHER = (
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
TOKENIZER = str(bundled.tokenizer_dir())


def leaked(text: str | bytes) -> list[str]:
    """Names of the canaries whose value occurs in `text`."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", "replace")
    return [name for name, value in CANARIES.items() if value.encode() in data]


def aws_env(tmp_path: Path, credentials: bool = True) -> dict[str, str]:
    """This process's environment with no AWS configuration of the machine's own, plus the canaries."""
    env = {k: v for k, v in os.environ.items() if k not in CANARIES and k not in _AWS_OTHER}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
    )
    if credentials:
        env.update(CANARIES)
    else:
        env["WANDB_API_KEY"] = CANARIES["WANDB_API_KEY"]
    return env


@pytest.fixture(autouse=True)
def _restore_hf_hub_offline(monkeypatch):
    """cli.main sets HF_HUB_OFFLINE=1 when it is unset: undo that after each test, as for any other env change."""
    value = os.environ.get("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", value or "")
    if value is None:
        monkeypatch.delenv("HF_HUB_OFFLINE")


@pytest.fixture
def set_env(monkeypatch):
    def apply(env: dict[str, str]) -> None:
        for name in [*CANARIES, *_AWS_OTHER]:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            if os.environ.get(name) != value:
                monkeypatch.setenv(name, value)

    return apply


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- S3 --------------------------------------------------------------------------------------------------------


class _EchoingS3(http.server.BaseHTTPRequestHandler):
    """An S3-compatible endpoint that rejects every request and echoes its headers (signature, key id, session
    token) in the error message — the worst case for a library message passed on to the user."""

    status, code = 400, "InvalidArgument"
    seen: list[dict] = []

    def _reply(self):
        self.seen.append(dict(self.headers))
        echo = " ".join(f"{k}={v}" for k, v in self.headers.items())
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code><Message>rejected: {echo}'
            "</Message></Error>"
        ).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _reply

    def log_message(self, *args):
        pass


@pytest.fixture
def echoing_s3():
    def start(status: int, code: str):
        handler = type("Handler", (_EchoingS3,), {"status": status, "code": code, "seen": []})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler.seen

    servers: list = []
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "status, code, message", [(400, "InvalidArgument", "cannot read"), (403, "AccessDenied", "access denied")]
)
def test_s3_error_that_echoes_the_request_shows_no_secret(status, code, message, echoing_s3, set_env, tmp_path, capsys):
    endpoint, seen = echoing_s3(status, code)
    set_env(aws_env(tmp_path))
    spec = "s3://bucket/regen/*.jsonl"
    started = time.perf_counter()
    code_, out, err = run_cli(
        [
            "prepare",
            "--data",
            spec,
            "--endpoint-url",
            endpoint,
            "--tokenizer",
            TOKENIZER,
            "--out",
            str(tmp_path / "shards"),
            "--no-progress",
        ],
        capsys,
    )
    assert code_ == 2 and f"{spec}: {message}" in err and "Traceback" not in err, err
    assert time.perf_counter() - started < 60
    # the server did receive the session token (and the key id), so the echo really carried them
    assert any(h.get("X-Amz-Security-Token") == CANARIES["AWS_SESSION_TOKEN"] for h in seen)
    assert leaked(out + err) == []
    assert not (tmp_path / "shards").exists()


def test_s3_without_credentials_fails_fast_without_network(set_env, tmp_path, capsys, monkeypatch):
    """No credentials anywhere: the error says how to provide them before any connection is made."""
    set_env(aws_env(tmp_path, credentials=False))
    connects = []
    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda s, addr: connects.append(addr) or real_connect(s, addr))
    spec = "s3://bucket/regen/*.jsonl"
    started = time.perf_counter()
    code, out, err = run_cli(
        [
            "prepare",
            "--data",
            spec,
            "--endpoint-url",
            f"http://127.0.0.1:{closed_port()}",
            "--tokenizer",
            TOKENIZER,
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2 and f"{spec}: no S3 credentials found" in err and "AWS_ACCESS_KEY_ID" in err, err
    assert time.perf_counter() - started < 10 and connects == []


def test_s3_unreachable_endpoint_in_a_subprocess(tmp_path):
    """As a user runs it: fake credentials, an endpoint on a closed loopback port; a bounded, clear failure."""
    spec, endpoint = "s3://bucket/data/part-0.jsonl", f"http://127.0.0.1:{closed_port()}"
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashdraft",
            "prepare",
            "--data",
            spec,
            "--endpoint-url",
            endpoint,
            "--tokenizer",
            TOKENIZER,
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=aws_env(tmp_path),
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{spec}: cannot connect to the S3 endpoint {endpoint} (EndpointConnectionError" in proc.stderr
    assert "raise s3.connect_timeout" in proc.stderr
    assert "Traceback" not in proc.stderr and leaked(proc.stdout + proc.stderr) == []
    assert time.perf_counter() - started < 120


# ---- a training run ----------------------------------------------------------------------------------------------


# Stands in for wandb where it is not installed (a named tracker must be): writes what it is sent into OUT, where
# the test looks for secrets like in every other file.
WANDB_STUB = """
import json, os

class _Run:
    id = "stub"

    def log(self, scalars, step):
        with open(os.path.join(_dir, "wandb_sent.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\\n")

    def finish(self):
        pass

def init(**kwargs):
    global _dir
    _dir = kwargs["dir"]
    with open(os.path.join(_dir, "wandb_sent.jsonl"), "a") as f:
        f.write(json.dumps({"init": kwargs}) + "\\n")
    return _Run()
"""


def test_training_run_writes_no_secret(tmp_path):
    """A short bundled run with the wandb tracker named: stdout, stderr and every file under OUT are clean."""
    import importlib.util

    out = tmp_path / "run"
    env = {**aws_env(tmp_path), "WANDB_MODE": "offline", "WANDB_SILENT": "true", "COLUMNS": "200"}
    stub = importlib.util.find_spec("wandb") is None
    if stub:
        (tmp_path / "stub" / "wandb").mkdir(parents=True)
        (tmp_path / "stub" / "wandb" / "__init__.py").write_text(WANDB_STUB)
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stub"), str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashdraft",
            "train",
            "--out",
            str(out),
            "train.max_steps=2",
            "log.every=1",
            "data.eval_limit=1",
            "data.eval_max_new_tokens=4",
            "log.trackers=[wandb]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leaked(proc.stdout + proc.stderr) == []
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"config.json", "metrics.jsonl", "measured_tau.json"} <= {p.name for p in files}
    if stub:
        sent = [json.loads(line) for line in (out / "wandb_sent.jsonl").read_text().splitlines()]
        assert "init" in sent[0] and [r["step"] for r in sent[1:]] == [0, 1, 2]  # step 0: the evaluation before
    dirty = {str(p.relative_to(out)): leaked(p.read_bytes()) for p in files}
    assert {name: found for name, found in dirty.items() if found} == {}
    assert json.loads((out / "config.json").read_text())["log"]["trackers"] == ["wandb"]


# ---- trust_remote_code -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Qwen3 target with the bundled tokenizer, and a drafter for it."""
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.target.tiny import random_tiny_model

    root = tmp_path_factory.mktemp("models")
    target = random_tiny_model("qwen3", num_layers=4, vocab_size=1088, seed=1)
    target.save_pretrained(root / "target")
    bundled.load_tokenizer().save_pretrained(root / "target")
    torch.manual_seed(0)
    drafter = DFlashDraftModel.from_target(
        target.config, num_layers=1, block_size=4, target_layer_ids=[1, 2], mask_token_id=1050
    )
    drafter.save_pretrained(root / "drafter")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    return root


@pytest.fixture
def hf_calls(monkeypatch):
    """Every transformers `from_pretrained` of the Auto classes, as (class, path, trust_remote_code passed)."""
    import transformers

    calls = []
    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"):
        cls = getattr(transformers, name)
        real = cls.from_pretrained

        def spy(path, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, str(path), kwargs.get("trust_remote_code", "not passed")))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    return calls


def test_remote_code_is_off_by_default():
    from flashdraft.config import RunConfig, load_config

    assert RunConfig().target.trust_remote_code is False
    assert load_config(bundled.ASSETS / "train.yaml").target.trust_remote_code is False
    for example in sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml")):
        assert load_config(example).target.trust_remote_code is False, example


def test_load_target_passes_trust_remote_code_only_when_asked(tiny_models, hf_calls):
    from flashdraft.config import TargetConfig
    from flashdraft.target import load_frozen_target

    load_frozen_target(tiny_models / "target", layer_ids=[1, 2])
    assert hf_calls and {trust for _, _, trust in hf_calls} == {False}, hf_calls
    hf_calls.clear()
    load_frozen_target(TargetConfig(path=str(tiny_models / "target"), trust_remote_code=True), layer_ids=[1, 2])
    assert hf_calls and {trust for _, _, trust in hf_calls} == {True}, hf_calls


def test_eval_never_trusts_remote_code(tiny_models, hf_calls, capsys, tmp_path):
    code, out, err = run_cli(
        [
            "eval",
            "--target",
            str(tiny_models / "target"),
            "--drafter",
            str(tiny_models / "drafter"),
            "--prompts",
            str(tiny_models / "prompts.jsonl"),
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capsys,
    )
    assert code == 0, err
    assert {name for name, _, _ in hf_calls} >= {"AutoTokenizer", "AutoModelForCausalLM"}
    assert {trust for _, _, trust in hf_calls} == {False}, hf_calls


def test_train_passes_the_config_value(tiny_models, hf_calls, capsys, tmp_path, monkeypatch):
    """The whole run — target, tokenizer, the full target for the measured τ — with the default (off)."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a busy 2-core machine
    try:
        code, out, err = run_cli(
            [
                "train",
                "--out",
                str(tmp_path / "run"),
                f"target.path={tiny_models / 'target'}",
                "drafter.init_from=null",
                "drafter.target_layer_ids=[1,2]",
                "train.max_steps=1",
                "data.eval_limit=1",
                "data.eval_max_new_tokens=2",
            ],
            capsys,
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert {name for name, _, _ in hf_calls} >= {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert {trust for _, _, trust in hf_calls} == {False}, hf_calls


# ---- no network by default -------------------------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Record (and refuse) every DNS lookup and connection attempt; clear HF_HUB_OFFLINE (unset: the default)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted in a test that forbids it")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: refuse(addr))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return attempts


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["eval", "--target", "flashdraft-tests/not-cached", "--drafter", "{drafter}", "--prompts", "{prompts}"],
            "target flashdraft-tests/not-cached is neither a local directory nor in the hub cache",
        ),
        (
            [
                "eval",
                "--target",
                "{target}",
                "--drafter",
                "flashdraft-tests/not-cached-drafter",
                "--prompts",
                "{prompts}",
            ],
            "drafter flashdraft-tests/not-cached-drafter is neither a local directory nor in the hub",
        ),
        (["train", "--out", "{out}", "target.path=flashdraft-tests/not-cached"], "set HF_HUB_OFFLINE=0 to download"),
        (
            ["train", "--out", "{out}", "drafter.init_from=flashdraft-tests/not-cached-drafter"],
            "drafter flashdraft-tests/not-cached-drafter is neither a local directory nor in the hub cache",
        ),
        (
            [
                "prepare",
                "--data",
                "{prompts}",
                "--tokenizer",
                "flashdraft-tests/not-cached-tokenizer",
                "--out",
                "{out}",
            ],
            "tokenizer flashdraft-tests/not-cached-tokenizer is neither a local directory nor in the hub cache",
        ),
    ],
    ids=["eval-target", "eval-drafter", "train-target", "train-init-from", "prepare-tokenizer"],
)
def test_uncached_hub_ids_are_an_offline_error(argv, message, tiny_models, no_network, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {
        "target": tiny_models / "target",
        "drafter": tiny_models / "drafter",
        "out": tmp_path / "out",
        "prompts": tiny_models / "prompts.jsonl",
    }
    started = time.perf_counter()
    code, out, err = run_cli([arg.format(**names) for arg in argv], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert no_network == [], "a connection was attempted"
    assert time.perf_counter() - started < 30


# The real CLI in a fresh process (HF libraries not imported yet, as for a user), with every DNS lookup and
# connection refused and reported on stderr.
GUARDED_CLI = """
import socket, sys
def refuse(*args, **kwargs):
    sys.stderr.write(f"NETWORK ATTEMPT {args[:1]}\\n")
    raise OSError("network access attempted")
socket.getaddrinfo = socket.create_connection = refuse
socket.socket.connect = lambda self, address: refuse(address)
from flashdraft.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def guarded(argv: list[str], hf_home: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # unset: the default
    env.update(HF_HOME=str(hf_home), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-c", GUARDED_CLI, *argv], capture_output=True, text=True, timeout=600, env=env, cwd=cwd
    )


def fake_hub_cache(hf_home: Path, repo: str, source: Path) -> None:
    """`source`'s files as the cached snapshot of hub repo `repo`, laid out as a download leaves them."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, base / "snapshots" / commit)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def test_uncached_hub_ids_in_a_subprocess(tmp_path, tiny_models):
    """An empty hub cache: `flashdraft eval` on hub ids stops at once (it used to retry a download for about a
    minute, then fail with exit 3) without a connection attempt."""
    started = time.perf_counter()
    proc = guarded(
        [
            "eval",
            "--target",
            "flashdraft-tests/not-cached",
            "--drafter",
            "flashdraft-tests/not-cached-2",
            "--prompts",
            str(tiny_models / "prompts.jsonl"),
        ],
        tmp_path / "hf-home",
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "neither a local directory nor in the hub cache" in proc.stderr and "HF_HUB_OFFLINE=0" in proc.stderr
    assert "Traceback" not in proc.stderr and "NETWORK ATTEMPT" not in proc.stderr
    assert time.perf_counter() - started < 60


def test_cached_hub_target_trains_without_network(tmp_path, tiny_models):
    """A hub id in the cache trains end to end — target, tokenizer, the full target for the measured τ — and
    nothing, flashdraft's code or transformers', tries to reach the Hub."""
    hf_home = tmp_path / "hf-home"
    fake_hub_cache(hf_home, "flashdraft-tests/tiny-target", tiny_models / "target")
    proc = guarded(
        [
            "train",
            "--out",
            str(tmp_path / "run"),
            "target.path=flashdraft-tests/tiny-target",
            "drafter.init_from=null",
            "drafter.target_layer_ids=[1,2]",
            "train.max_steps=1",
            "data.eval_limit=1",
            "data.eval_max_new_tokens=2",
        ],
        hf_home,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NETWORK ATTEMPT" not in proc.stderr and "measured τ" in proc.stdout
