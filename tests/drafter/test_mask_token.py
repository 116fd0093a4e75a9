"""choose_mask_token_id: explicit, known family, mask-like special token, padding row, or a clear error."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5TextConfig

from flashdraft.drafter import mask_token
from flashdraft.drafter.mask_token import choose_mask_token_id
from flashdraft.target.tiny import tiny_config

WORDS = ["[UNK]", "hello", "world", "the", "a", "What", "is", "2", "+", "4", "user", "assistant", "system"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"


def tokenizer(specials=("<|im_start|>", "<|im_end|>"), mask=None, template=TEMPLATE, eos=None):
    """A word-level tokenizer: WORDS (ids 0..12), then `specials`, then `mask` as the mask token."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_word_level(), unk_token="[UNK]", chat_template=template, eos_token=eos
    )
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if mask is not None:
        tok.add_special_tokens({"mask_token": mask})
    return tok


def _word_level():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def config(vocab_size=32):
    return tiny_config("qwen3", num_layers=4, vocab_size=vocab_size)


def test_explicit_id_wins():
    assert choose_mask_token_id(config(151936), mask_token_id=7) == (7, "mask_token_id=7 given explicitly")


def test_explicit_id_out_of_range():
    with pytest.raises(ValueError, match="vocab_size=32"):
        choose_mask_token_id(config(), mask_token_id=32)


def test_explicit_id_the_tokenizer_emits_is_kept_with_a_warning():
    token_id, reason = choose_mask_token_id(config(), tokenizer(), mask_token_id=1)
    assert token_id == 1 and "warning: it is a regular vocabulary token" in reason


@pytest.mark.parametrize(
    "target, expected",
    [
        (config(151936), 151669),
        (Qwen3_5TextConfig(), 248070),
        (Qwen3_5Config(), 248070),  # multimodal: read from text_config
    ],
)
def test_known_families_without_tokenizer(target, expected):
    token_id, reason = choose_mask_token_id(target)
    assert token_id == expected and "published" in reason


def test_known_id_beyond_a_small_tokenizer_is_kept():
    token_id, reason = choose_mask_token_id(config(151936), tokenizer())
    assert token_id == 151669 and "not emitted by the tokenizer" in reason


@pytest.mark.parametrize(
    "known_id, why",
    [
        (3, "regular vocabulary token"),  # "the"
        (13, "chat template uses '<|im_start|>'"),
    ],
)
def test_known_id_the_tokenizer_emits_is_skipped(monkeypatch, known_id, why):
    monkeypatch.setitem(mask_token.KNOWN_MASK_TOKENS, 32, (known_id, "Test"))
    token_id, reason = choose_mask_token_id(config(32), tokenizer())
    assert token_id == 15  # the first padding row: 13 words + 2 specials
    assert why in reason and "padding row" in reason


def test_eos_token_is_never_the_mask(monkeypatch):
    tok = tokenizer(eos="<eos>", template=None)
    monkeypatch.setitem(mask_token.KNOWN_MASK_TOKENS, 32, (tok.eos_token_id, "Test"))
    token_id, reason = choose_mask_token_id(config(32), tok)
    assert token_id == 16 and "eos_token '<eos>'" in reason


def test_mask_like_special_token():
    token_id, reason = choose_mask_token_id(config(32), tokenizer(mask="<|mask|>"))
    assert token_id == 15 and "'<|mask|>'" in reason
    token_id, _ = choose_mask_token_id(config(32), tokenizer(specials=["<|im_start|>", "<|im_end|>", "<MASK_1>"]))
    assert token_id == 15


def test_mask_like_token_used_by_the_chat_template_is_skipped():
    tok = tokenizer(mask="<|mask|>", template="{% for m in messages %}<|mask|>{{ m['content'] }}{% endfor %}")
    token_id, reason = choose_mask_token_id(config(32), tok)
    assert token_id == 16 and "chat template uses '<|mask|>'" in reason


def test_padding_row_and_zero_rows_skipped():
    token_id, reason = choose_mask_token_id(config(32), tokenizer())
    assert token_id == 15 and "padding row" in reason
    embeddings = torch.randn(32, 8)
    embeddings[15:17] = 0
    assert choose_mask_token_id(config(32), tokenizer(), embeddings=embeddings)[0] == 17


def test_no_candidate_says_how_to_fix():
    with pytest.raises(ValueError, match=r"mask_token_id=<id>.*add_special_tokens.*resize_token_embeddings"):
        choose_mask_token_id(config(15), tokenizer())
    with pytest.raises(ValueError, match="no tokenizer given"):
        choose_mask_token_id(config(32))
