"""Run by speculators' own interpreter (tests/interop/test_speculators.py): load an exported drafter with
speculators' model classes and write the logits it computes on the test's inputs.

    python speculators_logits.py EXPORT_DIR INPUTS.safetensors OUTPUTS.safetensors

It imports speculators, transformers, torch and safetensors (never flashdraft): what a user of speculators would
run. The context features come from the verifier the export names, at the layers speculators reads from the
export's config. The inputs hold the context's token ids (1, T), the block's token ids (1, B), where the drafting
slots start and, for DSpark and DFlash2, the token before each drafting slot (1, K).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


@torch.no_grad()
def main(export_dir: str, inputs_path: str, outputs_path: str) -> None:
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # not stored; flex attention otherwise
    model = SpeculatorModel.from_pretrained(export_dir, config=config, dtype=torch.float32).eval()
    inputs = load_file(inputs_path)
    block = inputs["block_ids"]
    verifier = AutoModelForCausalLM.from_pretrained(
        config.speculators_config.verifier.name_or_path, dtype=torch.float32
    )
    states = verifier(inputs["context_ids"], output_hidden_states=True).hidden_states
    features = torch.cat([states[i] for i in model.target_layer_ids], dim=-1)
    context = features.shape[1]
    x = model.embed_tokens(block)
    target_hidden = model.hidden_norm(model.fc(features))
    positions = torch.arange(context + block.shape[1])[None]
    position_embeddings = model.rotary_emb(x, positions)
    for layer in model.layers:  # no mask: the block sees the whole context and itself
        x = layer(
            hidden_states=x,
            target_hidden=target_hidden,
            attention_mask=None,
            position_ids=positions,
            position_embeddings=position_embeddings,
        )
    hidden = model.norm(x)
    start = int(inputs["first_slot"])
    slots = hidden[:, start:]
    outputs = {"logits": model.lm_head(slots)}
    if "prev_ids" in inputs:  # DSpark: the Markov bias of each slot's previous token, and the confidence
        prev = inputs["prev_ids"]
        outputs["logits"] = outputs["logits"] + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=slots)
        embedding = model.markov_head.prev_embeddings(prev).to(slots.dtype)
        outputs["confidence"] = model.confidence_head(torch.cat([slots, embedding], -1))
    if "selector_prev_ids" in inputs:  # DFlash2: the selector's candidates and their scores given the previous token
        candidates, scores = model.candidate_selector.select(outputs["logits"], slots, inputs["selector_prev_ids"])
        outputs.update(candidates=candidates, selector_scores=scores)
    save_file({k: v.float().contiguous() for k, v in outputs.items()}, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
