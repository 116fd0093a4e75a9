"""The prompts `flashdraft eval` and the measured τ decode: messages rendered with the chat template, bad lines named
(the command end to end: tests/cli/test_eval.py)."""

import json

import pytest

from flashdraft.speculative.prompts import load_prompts

from . import one_thread  # noqa: F401 (autouse fixture)

WORDS = "the a cat dog sat on mat ran far away and then home is good bad big small red blue".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<end>", "<user>", "<assistant>", "<system>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", chat_template=CHAT_TEMPLATE
    )


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "malformed JSON"),
        ('{"text": "hi"}', "expected a 'messages' or a 'prompt' field"),
        ('{"messages": "hi"}', "field 'messages': expected a list of messages"),
        ('{"prompt": 3}', "'prompt' must be a string"),
        ('{"prompt": "the cat", "category": 5}', "'category' must be a non-empty string"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "the cat"}), line])
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path, _tokenizer())
    assert f"{path}:2:" in str(info.value)


def test_chat_template_and_empty_file(tmp_path):
    tokenizer = _tokenizer()
    path = _write(tmp_path / "p.jsonl", [json.dumps({"messages": [{"role": "user", "content": "the cat"}]})])
    (prompt,) = load_prompts(path, tokenizer)
    assert tokenizer.decode(prompt.input_ids[0]) == "<user> the cat <end> <assistant>"
    assert prompt.category == "all" and prompt.line == 1
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(_write(tmp_path / "empty.jsonl", ["", "  "]), tokenizer)
