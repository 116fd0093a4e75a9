"""Decoding with the target's MTP layer is lossless, read from a checkpoint in the released layout.

Greedy: the output equals the target's own greedy decoding token for token (float64), with drafts both accepted
and rejected — the MTP head is trained for a few seconds on the target's own continuations so that it agrees
often but not always — and every round's drafts equal a recomputation from scratch (no cache, full target
forwards), which checks the MTP layer's cache, its cropping and the hidden states it is fed. Sampling: the
emitted tokens follow the target's exact distribution (chi-square, as for DFlash in test_sampling).
"""

import pytest
import torch

from flashdraft.speculative import rollback
from flashdraft.speculative.baselines import MTPProposer, mtp_generate
from flashdraft.target.mtp import MTPHead, chained, load_mtp, teacher_forced

from . import one_thread, ready, reference_greedy, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from .test_mtp_checkpoint import save_released_layout
from .test_sampling import P_MIN, PROMPT, VOCAB8, _exact_joint_of_tokens_2_and_3, chi_square_pvalue

PROMPT_LEN, NEW = 8, 32


def train_head(head, target, sequences, steps: int = 150, seed: int = 0):
    """A few Adam steps of the MTP loss (CE of the logits at p against token p + 2), the target frozen."""
    with torch.no_grad():
        hidden = target(sequences, output_hidden_states=True).hidden_states[-1]
    torch.manual_seed(seed)
    head.train().requires_grad_(True)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = target.get_output_embeddings()(teacher_forced(head, target, sequences, hidden)[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), sequences[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target and MTP head loaded back from a checkpoint in the released layout, prompts with their reference
    greedy continuations). The head is trained on the continuations of the first 6 prompts; the last 4 are unseen."""
    from transformers import AutoModelForCausalLM

    target = tiny_target("qwen3_5", seed=11)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (1, PROMPT_LEN), generator=g) for _ in range(10)]
    with ready(target):
        cases = [(p, reference_greedy(target, p, NEW)) for p in prompts]
        sequences = torch.cat([torch.cat([p[0], torch.tensor(out)])[None] for p, out in cases[:6]])
        head = train_head(MTPHead.for_target(target), target, sequences)
    directory = save_released_layout(target, head, tmp_path_factory.mktemp("mtp") / "checkpoint")
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    return loaded, load_mtp(loaded, directory), cases


def test_greedy_equals_target_greedy_with_partial_acceptance(setup):
    target, head, cases = setup
    accepted_drafts = []
    with ready(target):
        for i, (prompt, expected) in enumerate(cases):
            for num_drafts in (1, 3, 5):
                result = mtp_generate(target, head, prompt, NEW, num_drafts=num_drafts)
                assert result.tokens == expected, f"prompt {i}, {num_drafts} drafts"
                assert result.backend == "plain" and sum(result.acceptance_lengths) + 1 == len(expected)
                assert all(a >= b for a, b in zip(result.position_accepted, result.position_accepted[1:], strict=False))
                accepted_drafts += [a - 1 for a in result.acceptance_lengths[:-1]]
    # Rounds with every draft rejected, with some accepted, and with all 5 accepted.
    assert {0, 1, 2, 5} <= set(accepted_drafts)


@torch.inference_mode()
def _drafts_from_scratch(target, head, tokens: torch.Tensor, num_drafts: int) -> list[int]:
    """Greedy MTP drafts after `tokens`, recomputed without any cache: the target over tokens[:-1], then the MTP
    layer over every position of the chain so far."""
    hidden = target(tokens[None, :-1], output_hidden_states=True).hidden_states[-1]
    embed, rotary = target.get_input_embeddings(), target.get_decoder().rotary_emb
    inputs, drafts = tokens[1:], []
    for _ in range(num_drafts):
        positions = torch.arange(inputs.shape[0])[None]
        embeds = embed(inputs[None])
        out = head(embeds, hidden, rotary(embeds, positions), positions)
        drafts.append(int(target.get_output_embeddings()(out[0, -1]).argmax()))
        inputs, hidden = torch.cat([inputs, torch.tensor(drafts[-1:])]), torch.cat([hidden, out[:, -1:]], dim=1)
    return drafts


def test_drafts_equal_a_recomputation_without_cache(setup, monkeypatch):
    target, head, cases = setup
    rounds = []
    propose = MTPProposer.propose

    def recording(self, tokens, num_drafts):
        drafts, probs = propose(self, tokens, num_drafts)
        rounds.append((tokens.clone(), drafts.tolist()))
        assert rollback.kv_length(self.cache) == tokens.shape[0] - 1  # the chain's positions were cropped away
        return drafts, probs

    monkeypatch.setattr(MTPProposer, "propose", recording)
    with ready(target):
        for prompt, expected in (cases[0], cases[8]):
            assert mtp_generate(target, head, prompt, 24, num_drafts=4).tokens == expected[:24]
        for tokens, drafts in rounds:
            assert drafts == _drafts_from_scratch(target, head, tokens, len(drafts))
    assert len(rounds) > 8


@torch.inference_mode()
def test_chained_training_forward_is_what_serving_computes_entry_by_entry(setup):
    """`chained` (every anchor and step in one pass, as trained) equals the chain that serving builds from the same
    tokens, for every anchor and step: the layer over the target's states up to the anchor, then its own outputs."""
    target, head, cases = setup
    sequences = torch.cat([torch.cat([p[0], torch.tensor(out)])[None] for p, out in cases[:2]])
    steps = 3
    hidden = target(sequences, output_hidden_states=True).hidden_states[-1]
    outputs = chained(head, target, sequences, hidden, steps)
    n = sequences.shape[1] - steps - 1
    assert [o.shape for o in outputs] == [(2, n, hidden.shape[-1])] * steps
    first = teacher_forced(head, target, sequences, hidden)[:, :n]
    assert torch.allclose(outputs[0], first, rtol=0, atol=1e-12)
    embed, rotary = target.get_input_embeddings(), target.get_decoder().rotary_emb
    for b in range(2):
        for i in range(n):
            inputs, states = sequences[b, 1 : i + 2], hidden[b : b + 1, : i + 1]
            for k in range(1, steps + 1):
                positions = torch.arange(inputs.shape[0])[None]
                embeds = embed(inputs[None])
                out = head(embeds, states, rotary(embeds, positions), positions)[:, -1:]
                assert torch.allclose(out[0, 0], outputs[k - 1][b, i], rtol=0, atol=1e-10), (b, i, k)
                inputs = torch.cat([inputs, sequences[b, i + k + 1 : i + k + 2]])  # the next token, teacher-forced
                states = torch.cat([states, out], dim=1)
    with pytest.raises(ValueError, match="too short for 3 steps"):
        chained(head, target, sequences[:, :4], hidden[:, :4], steps)


def test_a_wrong_head_is_caught_by_verification_not_by_the_output(setup):
    """A head whose weights are scrambled still decodes the target's greedy output (drafts are only proposals),
    but its drafts are almost never accepted: the acceptance of the trained head is the head's, not the loop's."""
    target, head, cases = setup
    scrambled = MTPHead.for_target(target)
    scrambled.load_state_dict({k: v.flip(0) for k, v in head.state_dict().items()})
    with ready(target):
        trained = [mtp_generate(target, head, p, NEW, num_drafts=3) for p, _ in cases[:4]]
        wrong = [mtp_generate(target, scrambled.eval(), p, NEW, num_drafts=3) for p, _ in cases[:4]]
    assert [r.tokens for r in wrong] == [c for _, c in cases[:4]]
    rounds = sum(r.num_rounds for r in trained)
    assert rounds < sum(r.num_rounds for r in wrong) and sum(r.tau for r in trained) / 4 > 1.5


def test_positions_reach_qwen35s_rotary_per_axis(setup, monkeypatch):
    """Qwen3.5's rotary embedding of transformers 5.17 takes positions per axis, (3, B, T), and fails on (B, T)
    (an IndexError in the MTP runs on a GPU machine with that release); training and serving the MTP layer give it
    them per axis, and the outputs are those of a rotary that takes either."""
    target, head, cases = setup
    rotary = target.get_decoder().rotary_emb
    sequences = torch.cat([torch.cat([p[0], torch.tensor(c)])[None] for p, c in cases[:2]])
    with ready(target):
        hidden = target(sequences, output_hidden_states=True).hidden_states[-1]
        expected = teacher_forced(head, target, sequences, hidden), chained(head, target, sequences, hidden, 2)
        drafted = mtp_generate(target, head, cases[0][0], 12, num_drafts=3)
    forward = type(rotary).forward

    def per_axis_only(self, x, position_ids):
        assert position_ids.ndim == 3 and position_ids.shape[0] == 3, tuple(position_ids.shape)
        return forward(self, x, position_ids)

    monkeypatch.setattr(type(rotary), "forward", per_axis_only)
    with ready(target):
        assert torch.equal(teacher_forced(head, target, sequences, hidden), expected[0])
        assert all(
            torch.equal(a, b) for a, b in zip(chained(head, target, sequences, hidden, 2), expected[1], strict=True)
        )
        again = mtp_generate(target, head, cases[0][0], 12, num_drafts=3)
    assert again.tokens == drafted.tokens and again.acceptance_lengths == drafted.acceptance_lengths


def test_bad_arguments(setup):
    target, head, cases = setup
    with pytest.raises(ValueError, match="num_drafts must be >= 1"):
        mtp_generate(target, head, cases[0][0], 4, num_drafts=0)


def _sample_tokens_2_and_3(biased: bool, monkeypatch, trials: int = 1500) -> tuple[float, int, int]:
    """(p-value of x2, x3 against the target's exact joint distribution, runs with an accepted draft, trials).

    max_new_tokens 4 with 2 drafts puts x2 and x3 in one verified round (accept/accept, accept/correct, correct,
    then a new round). biased: the proposer reports a flattened q (sqrt q, renormalised: as if drawn at twice the
    temperature) beside drafts drawn from q, so the acceptance test min(1, p / q) is computed against the wrong q,
    and drafts are accepted too often — which the test must detect."""
    target = tiny_target("qwen3_5", num_layers=4, vocab_size=VOCAB8, seed=3, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions, so that drafts are often rejected and corrections matter
        target.get_output_embeddings().weight.mul_(30)
    torch.manual_seed(4)
    head = MTPHead.for_target(target)
    if biased:
        propose = MTPProposer.propose

        def flattened(self, tokens, num_drafts):
            drafts, probs = propose(self, tokens, num_drafts)
            return drafts, probs.sqrt() / probs.sqrt().sum(-1, keepdim=True)

        monkeypatch.setattr(MTPProposer, "propose", flattened)
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB8, VOCAB8)
    accepted_any = 0
    with ready(target):
        expected = _exact_joint_of_tokens_2_and_3(target, 1.0, 1.0, 0)
        for _ in range(trials):
            r = mtp_generate(target, head, PROMPT, 4, temperature=1.0, num_drafts=2, generator=g)
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted_any += any(a > 1 for a in r.acceptance_lengths)
    return chi_square_pvalue(counts, expected), accepted_any, trials


@pytest.mark.distribution
@pytest.mark.slow
def test_mtp_sampling_equals_target_distribution(monkeypatch):
    pvalue, accepted_any, trials = _sample_tokens_2_and_3(False, monkeypatch)
    assert pvalue > P_MIN, f"p-value {pvalue:.3g}"  # a false alarm once in 1000 runs of a correct sampler
    assert 0.05 * trials < accepted_any < 0.95 * trials  # both acceptance and rejection were exercised


@pytest.mark.distribution
@pytest.mark.slow
def test_the_sampling_check_detects_drafts_verified_against_the_wrong_q(monkeypatch):
    # p ~1e-6 at 500 trials and ~1e-116 at 1500 (seeded): 1000 keep a wide margin below P_MIN.
    pvalue, _, _ = _sample_tokens_2_and_3(True, monkeypatch, trials=1000)
    assert pvalue < P_MIN, f"p-value {pvalue:.3g}"
