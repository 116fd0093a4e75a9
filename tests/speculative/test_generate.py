"""Greedy speculative decoding reproduces the target's own greedy decoding token for token, on hybrid (MoE ones
too) and plain tiny targets (float64), whatever the drafter proposes; stop tokens and max_new_tokens are honoured
exactly."""

import pytest
import torch

from flashdraft import fastpath
from flashdraft.fastpath.patch import is_patched
from flashdraft.speculative import autoregressive_generate, generate, prompt_lookup_generate

from ..fastpath import crashes_unpatched_on_cpu
from . import (  # noqa: F401 (one_thread: autouse fixture)
    ScriptedDrafter,
    one_thread,
    random_drafter,
    ready,
    recorded_forwards,
    reference_greedy,
    tiny_target,
    verification_error,
)

FAMILIES = ["qwen3_5", "qwen3"]
CUDA = torch.cuda.is_available()
BLOCK_SIZES = (2, 4, 16)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    """(target, random drafter, prompts with their reference greedy continuations)."""
    target = tiny_target(request.param, seed=11)
    drafter = random_drafter(target, block_size=16, seed=12)
    g = torch.Generator().manual_seed(13)
    with ready(target):
        cases = []
        for i in range(16):
            prompt_len = 1 if i == 0 else int(torch.randint(2, 41, (1,), generator=g))
            max_new = 60 if i < 2 else int(torch.randint(1, 40, (1,), generator=g))
            prompt = torch.randint(0, 256, (1, prompt_len), generator=g)
            cases.append((prompt, max_new, reference_greedy(target, prompt, max_new)))
        yield target, drafter, cases


def _check_stats(result, block_size, offset=0):
    assert sum(result.acceptance_lengths) + 1 == len(result.tokens)
    assert all(1 <= a <= block_size + offset for a in result.acceptance_lengths)
    assert len(result.position_accepted) == block_size - 1 + offset
    assert all(0 <= a <= o for a, o in zip(result.position_accepted, result.position_offered, strict=True))
    # Acceptance is a prefix: position k + 1 is accepted only when position k was.
    assert all(a >= b for a, b in zip(result.position_accepted, result.position_accepted[1:], strict=False))
    assert result.num_target_forwards >= 1 + result.num_rounds


def test_greedy_equals_target_greedy_with_a_random_drafter(setup):
    target, drafter, cases = setup
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases):
            block_size = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            result = generate(target, drafter, prompt, max_new, block_size=block_size)
            assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), block size {block_size}"
            _check_stats(result, block_size)


@pytest.mark.parametrize("anchor_drafts", [True, False])
def test_greedy_dspark_equals_target_greedy(setup, anchor_drafts):
    """A DSpark drafter (its Markov head strong enough to change its drafts), in both block conventions."""
    target, _, cases = setup
    drafter = random_drafter(target, block_size=16, seed=14, family="dspark", sample_from_anchor=anchor_drafts)
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:8]):
            block_size = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            result = generate(target, drafter, prompt, max_new, block_size=block_size)
            assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), block size {block_size}"
            _check_stats(result, block_size, offset=int(anchor_drafts))


def test_greedy_dflash2_equals_target_greedy(setup):
    """A DFlash2 drafter (random convolutions, a selector strong enough to change its drafts), over several block
    sizes: a block shorter than the drafter's is one conv block."""
    target, _, cases = setup
    drafter = random_drafter(target, block_size=16, seed=15, family="dflash2")
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:8]):
            block_size = BLOCK_SIZES[i % len(BLOCK_SIZES)]
            result = generate(target, drafter, prompt, max_new, block_size=block_size)
            assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), block size {block_size}"
            _check_stats(result, block_size)


@pytest.mark.parametrize("block_size,error_rate", [(4, 0.3), (16, 0.08)])
def test_greedy_with_high_acceptance_covers_every_acceptance_length(setup, block_size, error_rate):
    """A drafter that knows the answer (wrong at `error_rate`): full blocks (no rollback) and every partial."""
    target, _, cases = setup
    accepted_drafts = set()
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:6]):
            script = prompt[0].tolist() + expected
            drafter = ScriptedDrafter(script, 256, block_size, error_rate, seed=i)
            with recorded_forwards(target) as forwards:
                result = generate(target, drafter, prompt, max_new)
            assert result.tokens == expected, f"prompt {i}"
            assert verification_error(target, forwards, script) < 1e-9  # each verification, not just argmax
            assert result.num_target_forwards == len(forwards)
            _check_stats(result, block_size)
            accepted_drafts.update(a - 1 for a in result.acceptance_lengths[:-1])
    assert {0, block_size - 1} <= accepted_drafts


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_hybrids_greedy_equals_target_greedy(family):
    """MoE hybrids (eager experts, float64), several prompts: a drafter that knows the target's greedy continuation
    but errs at a rate gives partial acceptances, full blocks and rollbacks, and the output is the target's own."""
    target = tiny_target(family, seed=11)
    g = torch.Generator().manual_seed(13)
    accepted_drafts = {4: set(), 8: set()}
    with ready(target):
        for i in range(4):
            prompt = torch.randint(0, 256, (1, int(torch.randint(2, 30, (1,), generator=g))), generator=g)
            expected = reference_greedy(target, prompt, 40)
            for block_size, error_rate in ((4, 0.3), (8, 0.12)):
                drafter = ScriptedDrafter(prompt[0].tolist() + expected, 256, block_size, error_rate, seed=i)
                with recorded_forwards(target) as forwards:
                    result = generate(target, drafter, prompt, 40)
                assert result.tokens == expected, f"prompt {i}, block size {block_size}"
                # Every verification's logits are those of a forward without cache: the rollback is exact.
                assert verification_error(target, forwards, prompt[0].tolist() + expected) < 1e-9
                assert result.num_target_forwards == len(forwards)  # the statistic counts the forwards that ran
                _check_stats(result, block_size)
                accepted_drafts[block_size].update(a - 1 for a in result.acceptance_lengths[:-1])
    for block_size, seen in accepted_drafts.items():  # rejections, full blocks and partial acceptances all happened
        assert {0, block_size - 1} < seen, (block_size, seen)


def test_deferred_tokens_are_committed_when_too_many(setup):
    """With max_deferred=2 a hybrid target commits long deferred runs by an extra forward; output unchanged."""
    target, drafter, cases = setup
    prompt, max_new, expected = cases[0]
    with ready(target):
        result = generate(target, drafter, prompt, max_new, block_size=4, max_deferred=2)
    assert result.tokens == expected
    extra = result.num_target_forwards - 1 - result.num_rounds
    if target.config.model_type == "qwen3":
        assert extra == 0  # a plain cache is cropped to the accepted prefix: nothing is ever deferred
    else:
        assert extra > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_max_new_tokens_is_exact(setup, block_size):
    target, _, cases = setup
    prompt, _, expected = cases[1]
    drafter = ScriptedDrafter(prompt[0].tolist() + expected, 256, block_size)
    with ready(target):
        for n in sorted({0, 1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size + 3}):
            result = generate(target, drafter, prompt, n)
            assert result.tokens == expected[:n], f"max_new_tokens={n}"
            assert not result.stopped


def test_stop_tokens(setup):
    target, drafter, cases = setup
    prompt, max_new, expected = cases[0]
    scripted = ScriptedDrafter(prompt[0].tolist() + expected, 256, 8)
    with ready(target):
        for j in (0, 5, len(expected) // 2):
            stop = expected[j]
            cut = expected[: expected.index(stop) + 1]
            for d in (drafter, scripted):
                result = generate(target, d, prompt, max_new, block_size=8, stop_token_ids=[stop, 300])
                assert result.tokens == cut and result.stopped
                assert sum(result.acceptance_lengths) + 1 == len(cut)
        absent = next(t for t in range(256) if t not in expected)
        assert generate(target, scripted, prompt, max_new, stop_token_ids=[absent]).tokens == expected


def test_matches_transformers_generate(setup):
    target, drafter, cases = setup
    with ready(target):
        for prompt, _, _ in cases[2:4]:
            hf = target.generate(
                prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            result = generate(target, drafter, prompt, 20, block_size=4)
            assert result.tokens == hf[0, prompt.shape[1] :].tolist()


def test_baselines_equal_target_greedy(setup):
    target, _, cases = setup
    with ready(target):
        for prompt, max_new, expected in cases[:3]:
            ar = autoregressive_generate(target, prompt, max_new)
            assert ar.tokens == expected and set(ar.acceptance_lengths) <= {1}
            assert ar.num_target_forwards == len(expected)
            pl = prompt_lookup_generate(target, prompt, max_new, block_size=8)
            assert pl.tokens == expected
            _check_stats(pl, 8)
        # Tiny random models repeat themselves, which prompt lookup drafts correctly now and then.
        prompt, max_new, expected = cases[0]
        assert max(prompt_lookup_generate(target, prompt, max_new, block_size=8).acceptance_lengths) >= 3


@pytest.fixture
def plain_hybrid():
    """A tiny hybrid Qwen3.5 as a user builds it with transformers (float32, on the CPU), in the state transformers
    left its modeling module at import (fla's kernels on 5.15-5.24, which crash on a CPU)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    torch.manual_seed(21)
    target = Qwen3_5ForCausalLM(config).eval()
    fastpath.disable(target)  # undo what an earlier test's entry point patched: a fresh process's state
    yield target
    fastpath.disable(target)


@pytest.mark.parametrize("entry", ["generate", "generate-engine", "autoregressive", "prompt-lookup"])
def test_entry_points_make_a_plain_transformers_model_runnable(plain_hybrid, entry):
    target = plain_hybrid
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(22))
    assert not is_patched(target)
    if crashes_unpatched_on_cpu(target) and not CUDA:
        with pytest.raises(Exception, match="active drivers"), torch.no_grad():
            target(prompt)  # what a user hits without the entry point's help (transformers 5.17-5.24)
    drafter = random_drafter(target, block_size=4, seed=23)
    run = {
        "generate": lambda: generate(target, drafter, prompt, 24, engine=False),
        "generate-engine": lambda: generate(target, drafter, prompt, 24, engine=True),
        "autoregressive": lambda: autoregressive_generate(target, prompt, 24, engine=False),
        "prompt-lookup": lambda: prompt_lookup_generate(target, prompt, 24, block_size=4, engine=False),
    }[entry]
    first = run()
    assert is_patched(target)
    hf = target.generate(
        prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    assert first.tokens == hf[0, prompt.shape[1] :].tolist()
    assert run().tokens == first.tokens  # applying the fast path again changes nothing


@pytest.mark.parametrize("block_size,refine", [(4, (1, 2)), (16, (1, 3, 7)), (16, (14,))])
def test_refined_drafting_keeps_greedy_exact(setup, block_size, refine):
    target, drafter, cases = setup
    with ready(target):
        for i, (prompt, max_new, expected) in enumerate(cases[:6]):
            result = generate(target, drafter, prompt, max_new, block_size=block_size, refine=refine)
            assert result.tokens == expected, f"prompt {i}, block size {block_size}, refine {refine}"
            _check_stats(result, block_size)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_pass_drafts_from_the_block_with_the_fixed_drafts(setup, temperature):
    """Pass by pass, the drafts (and at T > 0 the distributions they were drawn from) are those of an uncached
    drafter forward over the whole context and the block holding the drafts fixed so far."""
    from flashdraft.drafter import select_context_features
    from flashdraft.speculative.proposer import DFlashProposer
    from flashdraft.speculative.sampling import sampling_probs

    target, _, cases = setup
    drafter = random_drafter(target, block_size=16, seed=21)
    with torch.no_grad():  # larger weights than the initialisation's, so that the drafts depend on the block
        for weight in drafter.parameters():
            weight.mul_(30 if weight.ndim == 2 else 1)
    prompt = cases[1][0][0]
    anchor, mask = 7, drafter.mask_token_id
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with ready(target), torch.no_grad():
        hidden_states = target(input_ids=prompt[None], output_hidden_states=True).hidden_states
        context = select_context_features(hidden_states, drafter.target_layer_ids)

        def propose(refine):
            generator = torch.Generator().manual_seed(3)
            proposer = DFlashProposer(drafter, target, 16, temperature, generator=generator, refine=refine)
            proposer.observe(context)
            return proposer.propose(torch.cat([prompt, torch.tensor([anchor])]), 15)

        drafts, probs = propose((2, 5))
        block = torch.tensor([[anchor] + [mask] * 15])
        positions = torch.arange(prompt.numel() + 16)[None]
        for lo, hi in ((0, 2), (2, 5), (5, 15)):
            hidden = drafter(position_ids=positions, noise_embedding=embed(block), target_hidden=context)
            logits = drafter.compute_logits(hidden[0, 1 + lo : 1 + hi], head)
            if temperature == 0:
                assert drafts[lo:hi].tolist() == logits.argmax(-1).tolist(), (lo, hi)
            else:
                torch.testing.assert_close(probs[lo:hi], sampling_probs(logits, temperature, 1.0, 0))
            block[0, 1 + lo : 1 + hi] = drafts[lo:hi]
        assert (probs is None) == (temperature == 0)
        # The passes changed something: one pass alone drafts otherwise from the third draft on.
        single = propose(())
        assert drafts[:2].tolist() == single[0][:2].tolist()
        if temperature == 0:
            assert drafts[5:].tolist() != single[0][5:].tolist()
        else:
            assert not torch.allclose(probs[5:], single[1][5:])


def test_prompt_lookup_proposals():
    from flashdraft.speculative.baselines import PromptLookupProposer

    propose = PromptLookupProposer(ngram_max=3).propose
    tokens = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])
    assert propose(tokens, 3)[0].tolist() == [8, 9, 5]  # the trigram 5 6 7 continues with 8 9 5
    assert propose(torch.tensor([1, 2, 3, 2]), 5)[0].tolist() == [3, 2]  # unigram fallback, up to the end
    assert propose(torch.tensor([1, 2, 3]), 4)[0] is None


@pytest.mark.parametrize("engine", [False, True])
def test_bad_inputs(setup, engine):
    """The plain loop and the engine refuse the same requests with the same messages."""
    target, drafter, _ = setup
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="batch 1"):
        generate(target, drafter, torch.zeros(2, 3, dtype=torch.long), 4, engine=engine)
    with pytest.raises(ValueError, match="empty"):
        generate(target, drafter, torch.zeros(1, 0, dtype=torch.long), 4, engine=engine)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(target, drafter, ids, -1, engine=engine)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, drafter, ids, 4, temperature=-1.0, engine=engine)
    with pytest.raises(ValueError, match="top_p"):
        generate(target, drafter, ids, 4, temperature=1.0, top_p=0.0, engine=engine)
    with pytest.raises(ValueError, match="must ascend within 1 … 14"):
        generate(target, drafter, ids, 4, refine=(3, 2), engine=False)
    with pytest.raises(ValueError, match="must ascend within 1 … 2"):
        generate(target, drafter, ids, 4, block_size=4, refine=(3,), engine=False)
