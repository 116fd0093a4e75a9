"""Which token id fills the drafted positions of a block.

A block is `[anchor, MASK x (block_size - 1)]`, embedded with the target's frozen embedding, so MASK must be a row
of that embedding matrix that never stands for real text: if real text could contain it, the drafter would see
MASK both as "predict me" and as a genuine token, and the loss would sometimes ask it to predict MASK itself.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from flashdraft.drafter.config import target_text_config

# vocab_size -> (mask id used by the published DFlash drafters, family)
KNOWN_MASK_TOKENS = {
    248320: (248070, "Qwen3.5 / Qwen3.6"),
    151936: (151669, "Qwen3"),
}

_SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog. 1 + 1 = 2; print('hi')"
_SAMPLE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
]


def choose_mask_token_id(
    target_config: PreTrainedConfig,
    tokenizer=None,
    *,
    mask_token_id: int | None = None,
    embeddings: torch.Tensor | None = None,
) -> tuple[int, str]:
    """Pick the mask token id for a drafter of this target; return `(id, reason)` (the reason is for the user).

    In order of preference:
    1. `mask_token_id` when given (its range is checked; a warning is added to the reason if the tokenizer
       emits it);
    2. the id the published DFlash drafters use for the target's family, recognised by vocabulary size
       (248320 -> 248070 for Qwen3.5 / 3.6, 151936 -> 151669 for Qwen3) — with a tokenizer, only if the tokenizer
       cannot produce that id for normal text or through its chat template;
    3. a special token of the tokenizer whose content contains "mask" (and that the chat template does not use);
    4. the first *padding row* of the embedding: vocab sizes are rounded up (151936 for a 151669-token Qwen3
       tokenizer), and rows from `len(tokenizer)` to `vocab_size - 1` belong to no token. Such a row is safe:
       it exists in the frozen embedding (and the drafter, which embeds with the target's weights as served,
       finds the same row at inference), and since no text ever tokenizes to it, it is never a label nor a
       context token, so it can only mean MASK.

    `embeddings` (the target's input embedding weight, optional) lets candidates whose row is all zeros be
    skipped: a zero MASK embedding makes every drafted position identical after the first norm.

    Raises ValueError when none applies, saying how to pass an id or add a token.
    """
    text = target_text_config(target_config)
    vocab_size = int(text.vocab_size)
    emitted = _EmittedIds(tokenizer)

    if mask_token_id is not None:
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id must be in [0, vocab_size={vocab_size}), got {mask_token_id!r}")
        reason = f"mask_token_id={mask_token_id} given explicitly"
        why = emitted.why(mask_token_id)
        if why:
            reason += f" (warning: {why}, so real text can contain it)"
        return mask_token_id, reason

    rejected: list[str] = []

    def usable(token_id: int, label: str) -> bool:
        why = emitted.why(token_id) or _zero_row(embeddings, token_id)
        if why:
            rejected.append(f"{label} {token_id}: {why}")
        return not why

    known = KNOWN_MASK_TOKENS.get(vocab_size)
    if known is not None:
        token_id, family = known
        if usable(token_id, f"the {family} DFlash mask id"):
            checked = "not emitted by the tokenizer" if tokenizer is not None else "no tokenizer given to check it"
            return token_id, _with_rejected(
                f"{token_id}: the mask id of the published {family} DFlash drafters (vocab_size {vocab_size}; "
                f"{checked})",
                rejected,
            )

    if tokenizer is not None:
        for token_id, content in _mask_like_special_tokens(tokenizer):
            if token_id < vocab_size and usable(token_id, f"special token {content!r}"):
                return token_id, _with_rejected(f"{token_id}: the tokenizer's special token {content!r}", rejected)

        first_free = emitted.extent
        for token_id in range(first_free, vocab_size):
            if not _zero_row(embeddings, token_id):
                return token_id, _with_rejected(
                    f"{token_id}: an embedding padding row (the tokenizer has {first_free} tokens, the embedding "
                    f"{vocab_size} rows), which no text can tokenize to",
                    rejected,
                )
        if first_free < vocab_size:
            rejected.append(f"padding rows {first_free}..{vocab_size - 1}: all zero in the embedding")

    context = "; ".join(rejected) if rejected else "no known family for this vocab_size, no mask-like special token"
    if tokenizer is None:
        context += "; no tokenizer given to look for a mask token or padding rows"
    raise ValueError(
        f"cannot choose a mask token for this target (vocab_size {vocab_size}): {context}. "
        "Pass mask_token_id=<id> explicitly (an id in [0, vocab_size) that never occurs in your data, e.g. an "
        "unused reserved special token), or add one: tokenizer.add_special_tokens({'mask_token': '<|mask|>'}); "
        "target.resize_token_embeddings(len(tokenizer)); then save and serve that resized target with the drafter."
    )


def _with_rejected(reason: str, rejected: list[str]) -> str:
    return reason if not rejected else f"{reason} (skipped {'; '.join(rejected)})"


def _zero_row(embeddings: torch.Tensor | None, token_id: int) -> str:
    if embeddings is None or embeddings.device.type == "meta" or token_id >= embeddings.shape[0]:
        return ""
    return "" if bool(embeddings[token_id].any()) else "its embedding row is all zeros"


def _mask_like_special_tokens(tokenizer) -> list[tuple[int, str]]:
    found = {}
    if getattr(tokenizer, "mask_token_id", None) is not None:
        found[tokenizer.mask_token_id] = str(tokenizer.mask_token)
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False) and "mask" in str(token).lower():
            found.setdefault(token_id, str(token))
    return sorted(found.items())


class _EmittedIds:
    """Answers "can real data contain this id?" for one tokenizer (nothing is emitted without a tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._template_ids: set[int] | None = None
        if tokenizer is None:
            self.extent = 0
            return
        added = getattr(tokenizer, "added_tokens_decoder", {})
        # Added tokens may sit above len(tokenizer); nothing at or past `extent` can ever be produced.
        self.extent = max(len(tokenizer), max(added, default=-1) + 1)

    def why(self, token_id: int) -> str:
        """Empty if the tokenizer never produces `token_id`, else why it can."""
        tok = self.tokenizer
        if tok is None or token_id >= self.extent:
            return ""
        added = getattr(tok, "added_tokens_decoder", {}).get(token_id)
        if added is None:
            return "it is a regular vocabulary token"
        if not getattr(added, "special", False):
            return f"it is the non-special added token {str(added)!r}, matched in normal text"
        roles = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id")
        for role in roles:
            if getattr(tok, role, None) == token_id:
                return f"it is the tokenizer's {role.removesuffix('_id')} {str(added)!r}"
        if token_id in self.template_ids():
            return f"the chat template uses {str(added)!r}"
        return ""

    def template_ids(self) -> set[int]:
        if self._template_ids is None:
            self._template_ids = set()
            tok = self.tokenizer
            texts = [_SAMPLE_TEXT]
            if getattr(tok, "chat_template", None):
                for messages, prompt in ((_SAMPLE_CHAT, False), (_SAMPLE_CHAT[:2], True)):
                    try:
                        texts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
                    except Exception:  # a template may demand fields our sample lacks; the others still count
                        continue
            for text in texts:
                self._template_ids.update(tok(text, add_special_tokens=True)["input_ids"])
        return self._template_ids
