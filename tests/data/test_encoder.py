"""Records -> token ids + loss mask: exact masks on hand-made conversations, every format, errors in place."""

import numpy as np
import pytest

from flashdraft.data import DataError, Encoder, FormatConfig

SYSTEM = "You are a helpful assistant."


def test_single_turn_loss_on_assistant_only(tokenizer, loss_runs, make_chat):
    sample = Encoder(tokenizer).encode(make_chat(("user", "Hi"), ("assistant", "Hello there!")))
    assert tokenizer.decode(sample.input_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there!<|im_end|>\n"
    )
    assert loss_runs(sample) == ["Hello there!<|im_end|>"]
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    # exact positions: the run is the tokens of "Hello there!" and <|im_end|>, then the template's "\n" (no loss)
    n_loss = len(tokenizer("Hello there!", add_special_tokens=False)["input_ids"]) + 1
    assert sample.loss_mask.tolist() == [0] * (len(sample) - n_loss - 1) + [1] * n_loss + [0]


def test_multi_turn_with_system_prompt(tokenizer, loss_runs, make_chat):
    rec = make_chat(
        ("system", SYSTEM),
        ("user", "Hi"),
        ("assistant", "Hello there!"),
        ("user", "What is two plus two?"),
        ("assistant", "Two plus two is four."),
    )
    sample = Encoder(tokenizer).encode(rec)
    assert loss_runs(sample) == ["Hello there!<|im_end|>", "Two plus two is four.<|im_end|>"]
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(rec["messages"], tokenize=False)


def test_mask_matches_transformers_generation_mask(generation_tokenizer, make_chat):
    """On a template with {% generation %} markers, transformers computes the assistant mask itself: same answer."""
    convs = [
        make_chat(("user", "Hi"), ("assistant", "Hello there!")),
        make_chat(
            ("system", SYSTEM),
            ("user", "Hi"),
            ("assistant", "Hello"),
            ("user", "How are you?"),
            ("assistant", "I am fine, thank you. 🙂 héllo"),
        ),
        make_chat(("user", "x"), ("assistant", " leading and trailing spaces ")),
    ]
    enc = Encoder(generation_tokenizer)
    for rec in convs:
        ref = generation_tokenizer.apply_chat_template(
            rec["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        sample = enc.encode(rec)
        assert sample.input_ids.tolist() == ref["input_ids"]
        assert sample.loss_mask.tolist() == ref["assistant_masks"]


@pytest.mark.parametrize("drop", [False, True])
def test_inline_thinking_kept_or_dropped(tokenizer, loss_runs, make_chat, drop):
    rec = make_chat(("user", "Hi"), ("assistant", "<think>Let me think about it.</think>\n\nThe answer is 42."))
    sample = Encoder(tokenizer, FormatConfig(drop_thinking=drop)).encode(rec)
    if drop:
        assert loss_runs(sample) == ["The answer is 42.<|im_end|>"]
        assert "think" not in tokenizer.decode(sample.input_ids)
    else:
        assert loss_runs(sample) == ["<think>Let me think about it.</think>\n\nThe answer is 42.<|im_end|>"]


@pytest.mark.parametrize("drop", [False, True])
def test_reasoning_content_field(tokenizer, loss_runs, drop):
    """A template that ignores reasoning_content would lose it silently: it is written into the content instead."""
    answer = {"role": "assistant", "content": "Hello there!", "reasoning_content": "Let me think."}
    rec = {"messages": [{"role": "user", "content": "Hi"}, answer]}
    sample = Encoder(tokenizer, FormatConfig(drop_thinking=drop)).encode(rec)
    if drop:
        assert loss_runs(sample) == ["Hello there!<|im_end|>"]
    else:
        assert loss_runs(sample) == ["<think>\nLet me think.\n</think>\n\nHello there!<|im_end|>"]


def test_thinking_template_not_prefix_stable(thinking_tokenizer, loss_runs):
    """Qwen3-style: earlier turns lose their reasoning, the last turn gets a think block after the generation prompt.

    The loss covers exactly what the template renders for each assistant turn, think block included.
    """
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>Let me think.</think>\n\nHello there!"},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four.", "reasoning_content": "Let me think about it."},
    ]
    full = thinking_tokenizer.apply_chat_template(messages, tokenize=False)
    prefix = thinking_tokenizer.apply_chat_template(messages[:3], tokenize=False)
    assert not full.startswith(prefix)  # the naive prefix method would fail here
    sample = Encoder(thinking_tokenizer).encode({"messages": messages})
    assert thinking_tokenizer.decode(sample.input_ids) == full
    assert loss_runs(sample) == [
        "Hello there!<|im_end|>",
        "<think>\nLet me think about it.\n</think>\n\nTwo plus two is four.<|im_end|>",
    ]
    dropped = Encoder(thinking_tokenizer, FormatConfig(drop_thinking=True)).encode({"messages": messages})
    assert loss_runs(dropped) == ["Hello there!<|im_end|>", "<think>\n\n</think>\n\nTwo plus two is four.<|im_end|>"]


def test_template_kwargs_reach_the_template(thinking_tokenizer, loss_runs, make_chat):
    """enable_thinking=False: the empty think block is part of the generation prompt (given, not trained)."""
    rec = make_chat(("user", "Hi"), ("assistant", "Hello there!"))
    on = Encoder(thinking_tokenizer).encode(rec)
    off = Encoder(thinking_tokenizer, FormatConfig(template_kwargs={"enable_thinking": False})).encode(rec)
    assert on.input_ids.tolist() == off.input_ids.tolist()
    assert loss_runs(on) == ["<think>\n\n</think>\n\nHello there!<|im_end|>"]
    assert loss_runs(off) == ["Hello there!<|im_end|>"]


def test_odd_contents(tokenizer, loss_runs, make_chat):
    """Multi-byte characters, content equal to a template piece, a private-use character, an empty answer."""
    for answer in ["héllo 🙂 wörld", "assistant\n", "\ue000 private \ue000", "<|im_start|>"]:
        sample = Encoder(tokenizer).encode(make_chat(("user", "Hi"), ("assistant", answer)))
        assert loss_runs(sample) == [answer + "<|im_end|>"], answer
    sample = Encoder(tokenizer).encode(make_chat(("user", "Hi"), ("assistant", "")))
    assert loss_runs(sample) == ["<|im_end|>"]


def test_sharegpt_mapping(tokenizer, make_chat):
    sharegpt = {
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello there!"},
        ]
    }
    chat = make_chat(("system", SYSTEM), ("user", "Hi"), ("assistant", "Hello there!"))
    enc = Encoder(tokenizer)
    a, b = enc.encode(sharegpt), enc.encode(chat)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    # a top-level "system" field (a common ShareGPT variant) becomes the system message
    c = enc.encode({"system": SYSTEM, "conversations": sharegpt["conversations"][1:]})
    assert c.input_ids.tolist() == b.input_ids.tolist()
    # forcing the format reads the other key too, and content given as text parts is joined
    parts = make_chat(("user", "Hi"), ("assistant", "Hello there!"))
    parts["messages"][1]["content"] = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there!"}]
    d = Encoder(tokenizer, FormatConfig(format="sharegpt")).encode(parts)
    assert (
        d.input_ids.tolist() == enc.encode(make_chat(("user", "Hi"), ("assistant", "Hello there!"))).input_ids.tolist()
    )


def test_text_formats(tokenizer, loss_runs):
    enc = Encoder(tokenizer)
    whole = enc.encode({"text": "The quick brown fox."})
    assert tokenizer.decode(whole.input_ids) == "The quick brown fox." and whole.loss_mask.all()
    split = enc.encode({"prompt": "What is two plus two? ", "response": "Four."})
    assert loss_runs(split) == ["Four."]
    assert tokenizer.decode(split.input_ids) == "What is two plus two? Four."

    keep = Encoder(tokenizer, FormatConfig(split_marker="### Response:")).encode({"text": "Q? ### Response: Four."})
    assert loss_runs(keep) == [" Four."] and tokenizer.decode(keep.input_ids) == "Q? ### Response: Four."
    cut = FormatConfig(split_marker="<SPLIT>", keep_split_marker=False)
    removed = Encoder(tokenizer, cut).encode({"text": "Q?<SPLIT>Four."})
    assert loss_runs(removed) == ["Four."] and tokenizer.decode(removed.input_ids) == "Q?Four."
    with pytest.raises(DataError, match="split marker") as e:
        Encoder(tokenizer, cut).encode({"text": "no marker here"})
    assert e.value.reason == "no_split_marker"

    eos = Encoder(tokenizer, FormatConfig(append_eos=True)).encode({"prompt": "Q? ", "response": "Four."})
    assert loss_runs(eos) == ["Four.<|im_end|>"]


def test_pretokenized(tokenizer):
    enc = Encoder(tokenizer)
    s = enc.encode({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, True]})
    assert s.input_ids.tolist() == [5, 6, 7, 8] and s.loss_mask.tolist() == [0, 0, 1, 1]
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    cases = [
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "length_mismatch", "loss_mask", "3 tokens"),
        ({"input_ids": [1, 2, len(tokenizer)], "loss_mask": [0, 1, 1]}, "token_out_of_range", "input_ids", "outside"),
        ({"input_ids": [1, -1], "loss_mask": [0, 1]}, "token_out_of_range", "input_ids", "-1"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "wrong_type", "loss_mask", "0 or 1"),
        ({"input_ids": [1.5, 2], "loss_mask": [0, 1]}, "wrong_type", "input_ids", "integers"),
        ({"input_ids": ["a"], "loss_mask": [1]}, "wrong_type", "input_ids", "integers"),
        ({"input_ids": [True], "loss_mask": [1]}, "wrong_type", "input_ids", "booleans"),
        ({"input_ids": "1 2 3", "loss_mask": [1]}, "wrong_type", "input_ids", "list"),
        ({"input_ids": [], "loss_mask": []}, "empty_sample", "input_ids", "no tokens"),
        ({"input_ids": [1, 2]}, "missing_field", "loss_mask", "missing"),
    ]
    for rec, reason, field, text in cases:
        with pytest.raises(DataError, match=text) as e:
            enc.encode(rec)
        assert (e.value.reason, e.value.field) == (reason, field), rec


def test_batch_returns_errors_in_place(tokenizer, make_chat):
    good = make_chat(("user", "Hi"), ("assistant", "Hello"))
    out = Encoder(tokenizer).encode_batch([good, {"messages": []}, {"text": "plain"}])
    assert not isinstance(out[0], DataError) and isinstance(out[1], DataError) and not isinstance(out[2], DataError)


def test_no_chat_template(plain_tokenizer, make_chat):
    enc = Encoder(plain_tokenizer)
    with pytest.raises(DataError, match="no chat template.*--format text") as e:
        enc.encode_batch([make_chat(("user", "Hi"), ("assistant", "Hello"))])
    assert not e.value.skippable  # --skip-bad must not hide it
    assert enc.encode({"text": "still fine"}).loss_mask.all()
