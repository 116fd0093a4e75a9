"""The record formats: detection from the keys, every validation error of a record, thinking removed."""

import pytest

from flashdraft.data import DataError, Encoder, FormatConfig, detect_format
from flashdraft.data.formats import strip_thinking


def test_detection_and_forced_formats(tokenizer):
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"text": ""}) == "text"
    assert detect_format({"prompt": "", "response": ""}) == "text"
    assert detect_format({"input_ids": [], "loss_mask": []}) == "tokenized"
    with pytest.raises(DataError, match=r"keys \(foo, prompt\)") as e:
        detect_format({"foo": 1, "prompt": "x"})
    assert e.value.reason == "unknown_format"
    with pytest.raises(DataError, match="missing") as e:
        Encoder(tokenizer, FormatConfig(format="text")).encode({"messages": [{"role": "user", "content": "x"}]})
    assert e.value.field == "text"
    with pytest.raises(DataError) as e:
        Encoder(tokenizer, FormatConfig(format="chat")).encode({"text": "x"})
    assert (e.value.reason, e.value.field) == ("missing_field", "messages")
    with pytest.raises(ValueError, match="format: expected one of"):
        FormatConfig(format="jsonl")


@pytest.mark.parametrize(
    "record, reason, field",
    [
        ({"messages": []}, "empty_messages", "messages"),
        ({"messages": "hello"}, "wrong_type", "messages"),
        ({"messages": ["hello"]}, "wrong_type", "messages[0]"),
        ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown_role", "messages[0].role"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown_role", "conversations[0].from"),
        ({"messages": [{"content": "x"}]}, "missing_field", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
        ({"messages": [{"role": "user", "content": 3}]}, "wrong_type", "messages[0].content"),
        ({"messages": [{"role": 1, "content": "x"}]}, "wrong_type", "messages[0].role"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no_assistant", "messages"),
        (
            {"messages": [{"role": "assistant", "content": "x", "reasoning_content": 1}]},
            "wrong_type",
            "messages[0].reasoning_content",
        ),
        ({"text": 5}, "wrong_type", "text"),
        ({"text": ""}, "empty_sample", "text"),
        ({"prompt": "Q", "response": ""}, "empty_sample", "response"),
    ],
)
def test_chat_validation(tokenizer, record, reason, field):
    with pytest.raises(DataError) as e:
        Encoder(tokenizer).encode(record)
    assert (e.value.reason, e.value.field) == (reason, field)
    assert e.value.skippable
    assert f"field '{field}'" in str(e.value)


def test_strip_thinking():
    assert strip_thinking("<think>a\nb</think>\n\nanswer") == "answer"
    assert strip_thinking("reasoning without an opening tag</think>answer") == "answer"
    assert strip_thinking("answer <think>cut off") == "answer "
    assert strip_thinking("no thinking") == "no thinking"
