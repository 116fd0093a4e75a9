"""Bad inputs through the real CLI: each gives exit code 2 and a message naming the file, line or field (or, where
a bad record may be skipped, exit 0 with the skip counted and reported; or exit 4 when the output directory is held
by another run) — never a traceback, except with --debug. Every input path goes through the same checks: training
data, eval prompts, regeneration input, an offline features index (`PROMPTS`, `REGENERATE`, `FEATURES`).

Most cases call `flashdraft.cli.main` in-process (capsys); a representative subset runs `python -m flashdraft` in a
subprocess (`SUBPROCESS`), since the exit code and the absence of a traceback are what users see. The corpus is
built by the `corpus` fixture in a temporary directory: data files, YAML configs, a tiny target (with the bundled
tokenizer), drafters that fit it and drafters that do not, and broken checkpoints.

Decisions recorded here: `recipe.num_anchors` above `data.max_length` is a warning, not an error (anchors are drawn
per sequence from its response positions, all of them when there are fewer); a string where a list is expected
(`data.train=a.jsonl`) is an error that shows the list syntax, not a silent conversion.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flashdraft import bundled, cli
from flashdraft.io import lock

WIDTH = 250  # console columns: summary tables and messages are not wrapped, so fragments match
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # "{name}" is replaced by the corpus path of that name, "{out}" by a fresh directory
    code: int
    expect: tuple[str, ...]  # fragments of stdout + stderr (+ log records in-process), formatted like argv;
    # "re:..." is a regular expression instead (for the counts in the summary table)


def case(id: str, argv: str, code: int, *expect: str) -> Case:
    return Case(id, tuple(argv.split()), code, expect)


# --------------------------------------------------------------------------------------------------------------
# The corpus

D = "--no-progress --tokenizer {tok} --out {out}"  # the tail of every `prepare` command
EVAL = "eval --no-progress --max-new-tokens 4 --prompts {prompts}"
COUNT = r"\s*│\s*{}\s*│"  # a row of the summary table: label, then the count

# fmt: off
DATA = [
    case("data-malformed-json", "prepare --data {malformed} " + D, 2, "{malformed}:2: malformed JSON"),
    case("data-wrong-type", "prepare --data {wrong_type} " + D, 2,
         "{wrong_type}:1: field 'messages[0].content': expected a string, got int"),
    case("data-messages-not-a-list", "prepare --data {not_a_list} " + D, 2,
         "{not_a_list}:1: field 'messages': expected a list of messages, got str"),
    case("data-empty-messages", "prepare --data {empty_messages} " + D, 2,
         "{empty_messages}:1: field 'messages': empty conversation"),
    case("data-unknown-role", "prepare --data {unknown_role} " + D, 2,
         "{unknown_role}:2: field 'messages[0].role': unknown role 'wizard'"),
    case("data-no-assistant-turn", "prepare --data {no_assistant} " + D, 2,
         "{no_assistant}:1: field 'messages': no assistant turn"),
    case("data-not-utf8", "prepare --data {not_utf8} " + D, 2, "{not_utf8}:2: not valid UTF-8 (byte 13"),
    case("data-record-not-an-object", "prepare --data {not_an_object} " + D, 2,
         "{not_an_object}:1: expected a JSON object, got list"),
    case("data-token-id-out-of-range", "prepare --format tokenized --data {bad_ids} " + D, 2,
         "{bad_ids}:1: field 'input_ids': token id 999999 at position 2 is outside the vocabulary"),
    case("data-empty-file", "prepare --data {empty} " + D, 2, "{empty}: empty file (no records)"),
    case("data-missing-file", "prepare --data {d}/missing.jsonl " + D, 2, "{d}/missing.jsonl: no such file"),
    case("data-empty-glob", "prepare --data {d}/nothing-*.jsonl " + D, 2,
         "{d}/nothing-*.jsonl: matches no .jsonl, .jsonl.gz or .parquet file"),
    case("data-unsupported-type", "prepare --data {notes} " + D, 2, "{notes}: unsupported file type"),
    case("data-corrupt-gzip", "prepare --data {corrupt_gz} " + D, 2, "{corrupt_gz}: unreadable or corrupt file"),
    case("data-corrupt-parquet", "prepare --data {corrupt_parquet} " + D, 2,
         "{corrupt_parquet}: not a readable Parquet file"),
    case("data-overlong-dropped-and-counted", "prepare --data {long} --max-length 64 --overlong drop " + D, 0,
         "re:dropped \\(overlong\\)" + COUNT.format(1), "re:kept" + COUNT.format(1)),
    case("data-overlong-truncated-and-counted", "prepare --data {long} --max-length 64 " + D, 0,
         "re:truncated \\(overlong\\)" + COUNT.format(1), "re:kept" + COUNT.format(2)),
    case("data-skip-bad-counts-per-reason", "prepare --data {mixed} --skip-bad " + D, 0,
         "re:skipped" + COUNT.format(2), "re:kept" + COUNT.format(2),
         "re:malformed JSON" + COUNT.format(1) + r" \S*/mixed.jsonl:2: malformed JSON",
         "re:no assistant turn" + COUNT.format(1) + r" \S*/mixed.jsonl:3: field 'messages'"),
    case("data-chat-without-chat-template", "prepare --data {malformed} --no-progress --tokenizer {tok_plain} "
         "--out {out}", 2, "{tok_plain}' has no chat template"),
    case("data-missing-tokenizer", "prepare --data {malformed} --no-progress --tokenizer {d}/no-tokenizer "
         "--out {out}", 2, "tokenizer directory {d}/no-tokenizer does not exist"),
    case("data-bad-template-kwargs", "prepare --data {malformed} --template-kwargs {{bad " + D, 2,
         "--template-kwargs: not valid JSON"),
    case("train-data-no-assistant-turn", "train --out {out} data.train=[{no_assistant}] train.max_steps=1", 2,
         "{no_assistant}:1: field 'messages': no assistant turn"),
    case("train-data-missing-file", "train --out {out} data.train=[{d}/missing.jsonl]", 2,
         "{d}/missing.jsonl: no such file"),
    case("train-data-not-a-list", "train --out {out} data.train={malformed}", 2,
         "override data.train={malformed}: data.train: expected a list", "write data.train=[{malformed}]"),
]

CONFIGS = [
    case("config-unknown-key", "train --out {out} train.max_step=3", 2,
         "override train.max_step=3: unknown field train.max_step (did you mean train.max_steps?)"),
    case("config-unknown-section-in-file", "train --out {out} --config {cfg_unknown}", 2,
         "{cfg_unknown}: unknown field trainer"),
    case("config-wrong-type", "train --out {out} optim.lr=fast", 2,
         "override optim.lr=fast: optim.lr: expected float, got str 'fast'"),
    case("config-wrong-type-in-file", "train --out {out} --config {cfg_wrong_type}", 2,
         "{cfg_wrong_type}: train.epochs: expected int, got str 'six'"),
    case("config-block-size-1", "train --out {out} drafter.block_size=1", 2, "drafter.block_size = 1: must be >= 2"),
    case("config-layer-ids-beyond-target", "train --out {out} drafter.target_layer_ids=[1,99]", 2,
         "target_layer_ids [99] are out of range: the target has layers 0..7"),
    case("config-num-anchors-above-length-warns", "train --out {out} recipe.num_anchors=100000 train.max_steps=1 "
         "data.eval_prompts=null", 0, "recipe.num_anchors = 100000 exceeds data.max_length = 320", "clamped"),
    case("config-yaml-not-a-mapping", "train --out {out} --config {cfg_list}", 2,
         "{cfg_list}: expected a mapping of sections", "got a YAML list"),
    case("config-section-not-a-mapping", "train --out {out} --config {cfg_section}", 2,
         "{cfg_section}: optim: expected a mapping of fields, got int 3"),
    case("config-invalid-yaml", "train --out {out} --config {cfg_invalid}", 2, "{cfg_invalid}: not valid YAML"),
    case("config-not-utf8", "train --out {out} --config {cfg_binary}", 2, "{cfg_binary}: not a UTF-8 text file"),
    case("config-missing-file", "train --out {out} --config {d}/missing.yaml", 2,
         "config file {d}/missing.yaml does not exist"),
    case("config-override-not-yaml", "train --out {out} optim.lr=[1,", 2,
         "override 'optim.lr=[1,': the value is not valid YAML"),
    case("config-unknown-drafter-override",
         'train --out {out} drafter.init_from=null drafter.overrides={{"intermediate_sise":64}}', 2,
         "drafter.overrides.intermediate_sise: not a Qwen3Config field", "did you mean intermediate_size?"),
    case("config-override-of-a-loaded-drafter",
         'train --out {out} drafter.init_from=bundled drafter.overrides={{"intermediate_size":64}}', 2,
         "drafter.overrides = {{'intermediate_size': 64}}: cannot change a drafter loaded from drafter.init_from"),
    case("config-block-size-of-a-loaded-drafter", "train --out {out} drafter.init_from=bundled drafter.block_size=8", 2,
         "drafter.block_size = 8, but the drafter of drafter.init_from", "was trained with 16"),
    case("config-missing-tokenizer", "train --out {out} data.tokenizer={d}/no-tokenizer", 2,
         "data.tokenizer = {d}/no-tokenizer: no such directory"),
    case("config-missing-eval-prompts", "train --out {out} data.eval_prompts={d}/missing.jsonl", 2,
         "data.eval_prompts = {d}/missing.jsonl: no such file"),
]

MODELS = [
    case("model-eval-hidden-size-mismatch", EVAL + " --target {target} --drafter {drafter_h128}", 2,
         "drafter {drafter_h128} does not fit target {target}", "hidden_size: drafter 128, target 64"),
    case("model-eval-vocab-mismatch", EVAL + " --target {target} --drafter {drafter_v2048}", 2,
         "vocab_size: target 1088 has no row for the drafter's mask_token_id 2000"),
    case("model-eval-layer-count-mismatch", EVAL + " --target {target} --drafter {drafter_l12}", 2,
         "num_target_layers: drafter 12, target num_hidden_layers 4", "drafter reads target layers [9]"),
    case("model-export-hidden-size-mismatch", "export --drafter {drafter_h128} --out {out} --target {target}", 2,
         "hidden_size: drafter 128, target 64"),
    case("model-export-vocab-mismatch", "export --drafter {drafter_v2048} --out {out} --target {target}", 2,
         "vocab_size: target 1088 has no row for the drafter's mask_token_id 2000"),
    case("model-export-target-config-not-json", "export --drafter {drafter} --out {out} --target {bad_json}", 2,
         "--target {bad_json}: not valid JSON"),
    case("model-wrong-dflash-config", EVAL + " --target {target} --drafter {d_bad_dflash}", 2,
         "{d_bad_dflash}/config.json: dflash_config.target_layer_ids [1, 7] has [7] outside [0, 4)"),
    case("model-export-no-dflash-config", "export --drafter {d_no_dflash} --out {out}", 2,
         "{d_no_dflash}/config.json: dflash_config.target_layer_ids must be a non-empty list"),
    case("model-target-given-as-drafter", EVAL + " --target {target} --drafter {target}", 2,
         "{target}/config.json: not a DFlash drafter"),
    case("model-drafter-no-config", EVAL + " --target {target} --drafter {d_no_config}", 2,
         "drafter directory {d_no_config} has no config.json"),
    case("model-drafter-no-safetensors", EVAL + " --target {target} --drafter {d_no_weights}", 2,
         "drafter directory {d_no_weights} has no *.safetensors weights"),
    case("model-drafter-pickle-refused", "export --drafter {d_pickle} --out {out}", 2,
         "{d_pickle} holds only pickle weights (pytorch_model.bin)"),
    case("model-target-pickle-refused", EVAL + " --target {t_pickle} --drafter {drafter}", 2,
         "target {t_pickle} holds only pickle weights"),
    case("model-target-no-config", EVAL + " --target {t_no_config} --drafter {drafter}", 2,
         "target directory {t_no_config} has no config.json"),
    case("model-train-target-pickle-refused", "train --out {out} target.path={t_pickle}", 2,
         "target {t_pickle} holds only pickle weights"),
    case("model-chat-prompts-without-template", "eval --no-progress --prompts {prompts_chat} --target {t_no_template} "
         "--drafter {drafter}", 2, "{prompts_chat}:1: 'messages' needs a chat template"),
    case("model-missing-drafter", EVAL + " --target {target} --drafter {d}/no-drafter", 2,
         "drafter directory {d}/no-drafter does not exist"),
]

PROMPTS = [
    case("prompts-unknown-role", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_wizard}", 2,
         "{prompts_wizard}:1: field 'messages[0].role': unknown role 'wizard'"),
    case("prompts-not-utf8", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_binary}", 2,
         "{prompts_binary}:1: not valid UTF-8 (byte 0"),
    case("prompts-malformed-json", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_malformed}", 2,
         "{prompts_malformed}:2: malformed JSON"),
    case("prompts-content-not-text", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_content}", 2,
         "{prompts_content}:1: field 'messages[0].content': expected a string, got int"),
    case("prompts-missing-role", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_no_role}", 2,
         "{prompts_no_role}:1: field 'messages[0].role': missing"),
    case("prompts-not-an-object", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_list}", 2,
         "{prompts_list}:1: expected a JSON object, got list"),
    case("prompts-empty-file", EVAL + " --target {target} --drafter {drafter} --prompts {prompts_empty}", 2,
         "{prompts_empty}: no prompts"),
]

REGEN = "regenerate --no-progress --device cpu --max-new-tokens 2 --target {target} --out {out}/regen.jsonl"
REGENERATE = [
    case("regenerate-unknown-role", REGEN + " --data {unknown_role}", 2,
         "{unknown_role}:2: field 'messages[0].role': unknown role 'wizard'"),
    case("regenerate-not-utf8", REGEN + " --data {not_utf8}", 2, "{not_utf8}:2: not valid UTF-8 (byte 13"),
    case("regenerate-content-not-text", REGEN + " --data {wrong_type}", 2,
         "{wrong_type}:1: field 'messages[0].content': expected a string, got int"),
    case("regenerate-text-without-prompt", REGEN + " --data {text_only}", 2,
         "{text_only}:1: field 'text': a 'text' record has no prompt to continue"),
]

FEATURES = [
    case("features-index-not-json", "train --out {out} data.features={feat_garbled}", 2,
         "{feat_garbled}/features.json: not valid JSON"),
    case("features-index-missing-field", "train --out {out} data.features={feat_no_samples}", 2,
         "{feat_no_samples}/features.json: field 'samples': missing"),
    case("features-index-wrong-type", "train --out {out} data.features={feat_bad_width}", 2,
         "{feat_bad_width}/features.json: field 'hidden_size': expected a positive integer, got 'wide'"),
]

STORAGE = [
    case("config-s3-attempts-zero", "train --out {out} s3.attempts=0", 2,
         "override s3.attempts=0: s3.attempts = 0: must be >= 1"),
    case("cli-prepare-s3-timeout-zero", "prepare --data {malformed} --s3-read-timeout 0 " + D, 2,
         "--s3-read-timeout 0: s3.read_timeout = 0.0: must be > 0"),
    case("checkpoint-other-format", "train --resume --out {ckpt_future} data.eval_prompts=null", 2,
         "MANIFEST.json: checkpoint format 2, but this flashdraft reads format 1"),
    case("output-held-by-another-run", "train --out {busy}", 4,
         "{busy} is in use by another run: flashdraft train, pid"),
]

CLI = [
    case("cli-unknown-subcommand", "trian", 2, "invalid choice: 'trian'"),
    case("cli-missing-required-args", "prepare --data {malformed}", 2, "required: --tokenizer, --out"),
    case("cli-not-an-int", EVAL + " --target {target} --drafter {drafter} --limit many", 2,
         "argument --limit: invalid int value: 'many'"),
    case("cli-target-without-drafter", "eval --target {target} --prompts {prompts}", 2,
         "give both --target and --drafter"),
    case("cli-conflicting-out", "train --out {out} log.out={d}/elsewhere", 2,
         "--out {out} and log.out={d}/elsewhere disagree"),
    case("cli-override-without-equals", "train --out {out} optim.lr", 2, "override 'optim.lr': expected section.field"),
    case("cli-block-size-1", EVAL + " --target {target} --drafter {drafter} --block-size 1", 2,
         "--block-size 1: eval.block_size = 1: must be >= 2"),
    case("cli-resume-without-checkpoint", "train --out {out} --resume", 2,
         "--resume: no checkpoint in {out}/checkpoints"),
    case("cli-doctor-unknown-model", "doctor --model qwen9", 2, "--model 'qwen9': not a tiny family"),
]
# fmt: on

CASES = DATA + CONFIGS + MODELS + CLI + PROMPTS + REGENERATE + FEATURES + STORAGE
# Run as users run them: `python -m flashdraft ...` in a subprocess (a few seconds of start-up each).
SUBPROCESS = {
    "data-malformed-json",
    "data-chat-without-chat-template",
    "config-missing-file",
    "config-wrong-type",
    "model-eval-hidden-size-mismatch",
    "model-drafter-pickle-refused",
    "cli-unknown-subcommand",
    "cli-resume-without-checkpoint",
    "prompts-not-utf8",
    "output-held-by-another-run",
}


def test_the_corpus_is_large_and_ids_are_unique():
    assert len(CASES) >= 86 and len({c.id for c in CASES}) == len(CASES)
    assert SUBPROCESS <= {c.id for c in CASES}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """name -> path of every input the cases refer to."""
    root = tmp_path_factory.mktemp("bad-inputs")
    d = root / "data"
    d.mkdir()
    paths = {"d": str(d)}

    def data(name: str, content: str | bytes, filename: str | None = None) -> None:
        path = d / (filename or f"{name}.jsonl")
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths[name] = str(path)

    def line(record) -> str:
        return json.dumps(record) + "\n"

    def chat(*turns) -> dict:
        return {"messages": [{"role": r, "content": c} for r, c in turns]}

    good = line(GOOD_CHAT)
    data("malformed", good + '{"messages": [oops\n' + good)
    data("wrong_type", line(chat(("user", 5), ("assistant", "x"))))
    data("not_a_list", line({"messages": "hello"}))
    data("empty_messages", line({"messages": []}))
    data("unknown_role", good + line(chat(("wizard", "x"), ("assistant", "y"))))
    data("no_assistant", line(chat(("user", "anyone there?"))))
    data("not_utf8", good.encode() + b'{"text": "caf\xe9"}\n')
    data("not_an_object", "[1, 2]\n")
    data("bad_ids", line({"input_ids": [1, 2, 999999], "loss_mask": [0, 1, 1]}))
    data("empty", "")
    data("notes", "not data", "notes.txt")
    data("corrupt_gz", b"\x1f\x8bnot really gzip", "corrupt.jsonl.gz")
    data("corrupt_parquet", b"PAR1 garbage", "corrupt.parquet")
    data("long", good + line({"prompt": "def f():", "response": " return 1" * 200}))
    data("mixed", good + "{bad\n" + line(chat(("user", "x"))) + line({"text": "plain text counts"}))
    data("prompts", line({"prompt": "def add(a, b):"}))
    data("prompts_chat", line({"messages": [{"role": "user", "content": "hi"}]}))
    data("prompts_wizard", line({"messages": [{"role": "wizard", "content": "hi"}]}))
    data("prompts_binary", b'\xff\xfe{"prompt": "hi"}\n')
    data("prompts_malformed", line({"prompt": "hi"}) + '{"prompt": \n')
    data("prompts_content", line({"messages": [{"role": "user", "content": 5}]}))
    data("prompts_no_role", line({"messages": [{"content": "hi"}]}))
    data("prompts_list", "[1]\n")
    data("prompts_empty", "\n\n")
    data("text_only", line({"text": "plain text, nothing to answer"}))
    for name, index in [
        ("feat_garbled", '{"format": "flashdraft-features/1", "target'),
        (
            "feat_no_samples",
            json.dumps(
                {
                    "format": "flashdraft-features/1",
                    "target": "t",
                    "target_layer_ids": [1],
                    "hidden_size": 64,
                    "dtype": "float32",
                    "data_hash": "h",
                    "num_samples": 0,
                    "files": [],
                }
            ),
        ),
        (
            "feat_bad_width",
            json.dumps(
                {
                    "format": "flashdraft-features/1",
                    "target": "t",
                    "target_layer_ids": [1],
                    "hidden_size": "wide",
                    "dtype": "float32",
                    "data_hash": "h",
                    "num_samples": 0,
                    "files": [],
                    "samples": [],
                }
            ),
        ),
    ]:
        (root / name).mkdir()
        (root / name / "features.json").write_text(index)
        paths[name] = str(root / name)
    future = root / "ckpt_future" / "checkpoints" / "step_00000001"
    future.mkdir(parents=True)
    (future / "MANIFEST.json").write_text(json.dumps({"format": 2, "step": 1, "files": {}}))
    paths["ckpt_future"] = str(root / "ckpt_future")
    # Held by a live run on this host: this test process, under a token it does not hold itself.
    busy = root / "busy"
    busy.mkdir()
    (busy / lock.LOCK_NAME).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": "train",
                "started": 0,
                "token": "someone-else",
                "proc_start": lock._proc_start(os.getpid()),
            }
        )
    )
    paths["busy"] = str(busy)
    (root / "bad.json").write_text("{not json")
    paths["bad_json"] = str(root / "bad.json")

    for name, text in [
        ("cfg_unknown", "trainer:\n  epochs: 1\n"),
        ("cfg_wrong_type", "train:\n  epochs: six\n"),
        ("cfg_list", "- train\n- data\n"),
        ("cfg_section", "optim: 3\n"),
        ("cfg_invalid", "train: [1,\n"),
    ]:
        (root / f"{name}.yaml").write_text(text)
        paths[name] = str(root / f"{name}.yaml")
    (root / "cfg_binary.yaml").write_bytes(b"train:\n  epochs: \xff\xfe\n")
    paths["cfg_binary"] = str(root / "cfg_binary.yaml")

    tok = root / "tok"
    shutil.copytree(bundled.tokenizer_dir(), tok)
    plain = root / "tok_plain"
    shutil.copytree(tok, plain)
    (plain / "chat_template.jinja").unlink()
    paths.update(tok=str(tok), tok_plain=str(plain))
    paths.update(_models(root / "models", bundled.load_tokenizer()))
    return paths


def _models(root: Path, tokenizer) -> dict[str, str]:
    """A tiny Qwen3 target (4 layers, hidden 64, the bundled tokenizer), drafters that fit it or not, broken dirs."""
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.target.tiny import random_tiny_model, tiny_config

    paths = {}

    def drafter(name, target_config, **kwargs):
        torch.manual_seed(0)
        model = DFlashDraftModel.from_target(target_config, num_layers=1, block_size=4, **kwargs)
        model.save_pretrained(root / name)
        paths[name] = str(root / name)

    target = random_tiny_model("qwen3", num_layers=4, vocab_size=1088, seed=1)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    paths["target"] = str(root / "target")
    drafter("drafter", target.config, target_layer_ids=[1, 2], mask_token_id=1050)
    drafter(
        "drafter_h128",
        tiny_config("qwen3", 4, vocab_size=1088, hidden_size=128),
        target_layer_ids=[1, 2],
        mask_token_id=1050,
    )
    drafter("drafter_v2048", tiny_config("qwen3", 4, vocab_size=2048), target_layer_ids=[1, 2], mask_token_id=2000)
    drafter("drafter_l12", tiny_config("qwen3", 12, vocab_size=1088), target_layer_ids=[1, 9], mask_token_id=1050)

    def broken(name, source, drop=(), add=(), edit=None):
        shutil.copytree(root / source, root / name)
        for file in drop:
            (root / name / file).unlink()
        for file in add:
            (root / name / file).write_bytes(b"a pickle that must never be loaded")
        if edit is not None:
            config = json.loads((root / name / "config.json").read_text())
            edit(config)
            (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = str(root / name)

    broken("d_bad_dflash", "drafter", edit=lambda c: c["dflash_config"].update(target_layer_ids=[1, 7]))
    broken("d_no_dflash", "drafter", edit=lambda c: c.pop("dflash_config"))
    broken("d_no_config", "drafter", drop=["config.json"])
    broken("d_no_weights", "drafter", drop=["model.safetensors"])
    broken("d_pickle", "drafter", drop=["model.safetensors"], add=["pytorch_model.bin"])
    broken("t_pickle", "target", drop=["model.safetensors"], add=["pytorch_model.bin"])
    broken("t_no_config", "target", drop=["config.json"])
    broken("t_no_template", "target", drop=["chat_template.jinja"])
    return paths


def _argv(c: Case, corpus: dict, out: Path) -> list[str]:
    names = {**corpus, "out": str(out)}
    return [arg.format(**names) for arg in c.argv]


def _expected(c: Case, corpus: dict, out: Path) -> list[str]:
    names = {**corpus, "out": str(out)}
    return [fragment if fragment.startswith("re:") else fragment.format(**names) for fragment in c.expect]


def _check(c: Case, code: int, text: str, stderr: str, corpus: dict, out: Path) -> None:
    assert code == c.code, f"{c.id}: exit {code}, expected {c.code}\n{text[-3000:]}"
    for fragment in _expected(c, corpus, out):
        found = re.search(fragment[3:], text) if fragment.startswith("re:") else fragment in text
        assert found, f"{c.id}: {fragment!r} not in the output:\n{text[-3000:]}"
    assert "Traceback" not in stderr
    assert "internal error" not in stderr


# --------------------------------------------------------------------------------------------------------------
# In-process: flashdraft.cli.main with captured output


@pytest.fixture(autouse=True)
def _restore_hf_hub_offline(monkeypatch):
    """cli.main sets HF_HUB_OFFLINE=1 when it is unset: undo that after each test, as for any other env change."""
    value = os.environ.get("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", value or "")
    if value is None:
        monkeypatch.delenv("HF_HUB_OFFLINE")


@pytest.fixture
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only contend on a busy 2-core machine
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("c", [c for c in CASES if c.id not in SUBPROCESS], ids=lambda c: c.id)
def test_bad_input_in_process(c, corpus, tmp_path, capsys, caplog, one_thread, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing lands in the working tree
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    out = tmp_path / "out"
    try:
        code = cli.main(_argv(c, corpus, out))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    stdout, stderr = capsys.readouterr()
    # pytest's log capture takes the records that `flashdraft train` would print on stderr
    _check(c, code, stdout + stderr + caplog.text, stderr, corpus, out)


# --------------------------------------------------------------------------------------------------------------
# Subprocesses: `python -m flashdraft`, started together (start-up is most of their time)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "COLUMNS": str(WIDTH)}
    return subprocess.run(
        [sys.executable, "-m", "flashdraft", *argv], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


@pytest.fixture(scope="module")
def subprocess_runs(corpus, tmp_path_factory):
    """Case id -> (completed process, out dir); plus "--debug" runs of one case with and without --debug."""
    root = tmp_path_factory.mktemp("subprocess")
    jobs = {}
    for c in CASES:
        if c.id in SUBPROCESS:
            out = root / c.id
            jobs[c.id] = (_argv(c, corpus, out), out)
    jobs["debug"] = (["--debug", "train", "--config", f"{corpus['d']}/missing.yaml"], root / "debug")
    jobs["debug-after-subcommand"] = (["train", "--config", f"{corpus['d']}/missing.yaml", "--debug"], root / "d2")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(_run, argv, root) for key, (argv, _) in jobs.items()}
        return {key: (future.result(), jobs[key][1]) for key, future in futures.items()}


@pytest.mark.parametrize("c", [c for c in CASES if c.id in SUBPROCESS], ids=lambda c: c.id)
def test_bad_input_subprocess(c, corpus, subprocess_runs):
    proc, out = subprocess_runs[c.id]
    _check(c, proc.returncode, proc.stdout + proc.stderr, proc.stderr, corpus, out)


def test_debug_shows_the_traceback_the_normal_run_hides(corpus, subprocess_runs):
    normal, _ = subprocess_runs["config-missing-file"]
    assert normal.returncode == 2 and "Traceback" not in normal.stderr
    for key in ("debug", "debug-after-subcommand"):
        debug, _ = subprocess_runs[key]
        assert "Traceback (most recent call last)" in debug.stderr, key
        assert "ConfigError: config file" in debug.stderr and debug.returncode not in (0, 2), key
