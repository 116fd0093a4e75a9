"""Fixtures for flashdraft.data: a tiny offline tokenizer with chat templates, file writers, a moto S3 server."""

from __future__ import annotations

import copy
import gzip
import json

import numpy as np
import pytest

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "system user assistant tool You are a helpful assistant. Hello there! How are you? I am fine, thank you. "
    "What is two plus two? Two plus two is four. <think> Let me think about it. </think> The answer is 42. "
    "### Response: The quick brown fox jumps over the lazy dog."
] * 3

# Qwen-style: <|im_start|>role\ncontent<|im_end|>\n, with a generation prompt.
CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A Qwen3-style thinking template: reasoning (reasoning_content, or <think>...</think> in the content) is shown
# only for assistant turns after the last user message, and the last turn always gets a (maybe empty) think block;
# earlier turns lose their reasoning; enable_thinking=False puts an empty think block in the generation prompt.
# Rendering a prefix of the conversation is therefore NOT a prefix of the
# full rendering.
THINKING = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
{%- set content = m.content %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# CHATML with {% generation %} markers, so transformers' return_assistant_tokens_mask can check our mask.
GENERATION = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{ message['content'] + '<|im_end|>' }}{%- endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE (~350 tokens) trained in milliseconds, ChatML template, EOS <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    hf.name_or_path = "tiny-chatml"
    return hf


def _with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def thinking_tokenizer(tokenizer):
    return _with_template(tokenizer, THINKING)


@pytest.fixture(scope="session")
def generation_tokenizer(tokenizer):
    return _with_template(tokenizer, GENERATION)


@pytest.fixture(scope="session")
def plain_tokenizer(tokenizer):
    return _with_template(tokenizer, None)


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def plain_tokenizer_dir(plain_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok-plain")
    plain_tokenizer.save_pretrained(path)
    return path


def _write_jsonl(path, records, gz: bool = False) -> str:
    """Write records (dicts are JSON-encoded; str/bytes are written as the raw line) one per line."""
    lines = []
    for r in records:
        if isinstance(r, bytes):
            lines.append(r)
        elif isinstance(r, str):
            lines.append(r.encode())
        else:
            lines.append(json.dumps(r).encode())
    data = b"\n".join(lines) + (b"\n" if lines else b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


@pytest.fixture
def write_jsonl():
    return _write_jsonl


@pytest.fixture
def write_parquet():
    def write(path, records, row_group_size: int | None = None) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
        return str(path)

    return write


@pytest.fixture
def loss_runs(tokenizer):
    """The decoded text of each maximal run of loss tokens: what the drafter is trained to produce."""

    def runs(sample) -> list[str]:
        ids, mask = np.asarray(sample.input_ids), np.asarray(sample.loss_mask).astype(bool)
        out, cur = [], []
        for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
            if m:
                cur.append(t)
            elif cur:
                out.append(tokenizer.decode(cur))
                cur = []
        if cur:
            out.append(tokenizer.decode(cur))
        return out

    return runs


def chat(*turns, **extra) -> dict:
    """chat(("user", "Hi"), ("assistant", "Hello")) -> {"messages": [...]}"""
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


@pytest.fixture
def make_chat():
    return chat


# ---- S3 (moto in server mode; real s3fs / aiobotocore over HTTP)

FAKE_KEY_ID = "AKIAFLASHDRAFTTEST01"
FAKE_SECRET = "fLaShDrAfT/sEcReT+kEy/ShOuLdNeVeRbEpRiNtEd0"
_AWS_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
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


@pytest.fixture(scope="session")
def moto_server():
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """An environment with no AWS credentials anywhere (no env vars, no files, no instance metadata)."""
    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3(moto_server, no_aws, monkeypatch):
    """Fake credentials for this test only, and a fresh bucket; yields (boto3 client, bucket, endpoint)."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    client = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    bucket = f"fd-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield client, bucket, moto_server


# ---- checksummed files to damage (test_checksums.py, test_verify.py)


def flip(path, offset: int) -> None:
    """Flip one bit of the byte at `offset` of file `path` (negative: from the end), as rot on a disk would."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def make_shards():
    """make_shards(out, n) -> (out, samples): n samples of 1-39 tokens written by the real ShardWriter."""
    from flashdraft.data import Sample, ShardWriter

    def make(out, n: int = 600, seed: int = 0):
        rng = np.random.default_rng(seed)
        samples = []
        with ShardWriter(out) as writer:
            for _ in range(n):
                length = int(rng.integers(1, 40))
                samples.append(
                    Sample(rng.integers(0, 300, length).astype(np.int32), (rng.random(length) < 0.5).astype(np.uint8))
                )
                writer.add(samples[-1])
            writer.commit({"content_hash": f"test-{n}-{seed}"})
        return out, samples

    return make


class FakeTarget:
    """What `write_features` reads of a target, with features that are a function of the tokens: no model runs."""

    def __init__(self, layers=(1, 2, 3, 4, 5), hidden: int = 4, vocab: int = 300):
        import torch

        self.target_layer_ids, self.hidden_size, self.final_hidden = list(layers), hidden, False
        self.dtype, self.device, self.name_or_path = torch.bfloat16, torch.device("cpu"), "fake-target"
        self.lm_head_weight = torch.arange(vocab * hidden, dtype=torch.bfloat16).view(vocab, hidden)
        embed = torch.nn.Embedding(vocab, hidden)
        self.model = type("Model", (), {"get_input_embeddings": lambda _: embed})()
        config = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": 8, "vocab_size": vocab}
        self.config = type("Config", (), {"to_json_string": lambda _: json.dumps(config)})()

    def capture(self, x, mask):
        import torch

        width = len(self.target_layer_ids) * self.hidden_size
        return (x[..., None].float() + torch.arange(width) / width).to(self.dtype)


@pytest.fixture
def make_features(make_shards):
    """make_features(root) -> (FeatureStore url, TokenizedDataset): the features of 6 samples, written by the real
    `write_features` from a FakeTarget, and the shards they were captured from."""
    from flashdraft.data import TokenizedDataset
    from flashdraft.data.features import write_features

    def make(root, n: int = 6):
        data = TokenizedDataset(make_shards(root / "shards", n)[0])
        write_features(FakeTarget(), data, str(root / "features"))
        return str(root / "features"), data

    return make


def sample_offset(part, index: int) -> int:
    """Where the bytes of sample `index` begin in safetensors file `part`."""
    import struct

    raw = part.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8 : 8 + n])[str(index)]["data_offsets"][0]
