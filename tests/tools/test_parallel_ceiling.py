"""tools/parallel_ceiling.py: the Monte Carlo acceptance of drafts drawn from the target's marginals,
against the exact value enumerated over every block on a target with a 5-token vocabulary whose next-token
distributions depend strongly on the tokens before them; and the script end to end on the bundled target."""

import itertools
import json

import pytest
import torch

from flashdraft.target.tiny import random_tiny_model
from tests.scripts import TOOLS, load_script

VOCAB, DRAFTS = 5, 3


@pytest.fixture(scope="module")
def ceiling():
    return load_script(TOOLS / "parallel_ceiling.py")


@pytest.fixture(scope="module")
def target(ceiling):
    # Large initial weights: peaked distributions that change with every token before them (a small init gives
    # nearly uniform ones, where marginals and conditionals agree and every draft would be accepted).
    model = random_tiny_model("qwen3_5", vocab_size=VOCAB, dtype=torch.float64, seed=0, initializer_range=0.5)
    return ceiling.Target(model.requires_grad_(False), temperature=1.0)


def exact_acceptance(target, context: torch.Tensor) -> torch.Tensor:
    """Per draft position, the probability that every draft up to it is accepted, summed over all VOCAB**DRAFTS
    blocks: drafts drawn independently from the exact marginals, each accepted with min(1, p / q)."""
    blocks = torch.tensor(list(itertools.product(range(VOCAB), repeat=DRAFTS)))
    rows = torch.cat([context.expand(len(blocks), -1), blocks], dim=1)
    with torch.no_grad():
        probs = target.probs(rows, target.new_cache())[:, context.shape[0] - 1 :]  # [blocks, DRAFTS + 1, V]
    # conditional[b, k]: the target's probability of draft k of block b given the drafts before it.
    conditional = probs[:, :DRAFTS].gather(2, blocks[..., None])[..., 0]
    path = conditional.cumprod(dim=1)  # the probability that the target samples the block's first k + 1 tokens
    # marginal[k, v]: the probability that the target samples v at draft position k. Every prefix of k + 1 drafts
    # stands in VOCAB ** (DRAFTS - k - 1) blocks, so the sum over blocks counts each that many times.
    marginal = torch.zeros(DRAFTS, VOCAB, dtype=torch.float64)
    for k in range(DRAFTS):
        marginal[k].scatter_add_(0, blocks[:, k], path[:, k] / VOCAB ** (DRAFTS - k - 1))
    q = marginal.gather(1, blocks.T).T  # [blocks, DRAFTS]
    draw = q.prod(dim=1)  # the probability of drawing the whole block from the marginals
    accept = torch.minimum(torch.ones_like(q), conditional / q).cumprod(dim=1)
    return (draw[:, None] * accept).sum(dim=0)


def test_monte_carlo_matches_the_exact_acceptance(ceiling, target):
    context = torch.tensor([4, 0, 2])
    exact = exact_acceptance(target, context)
    # The case must be one where position matters: the first draft comes from the exact conditional, later ones
    # are rejected more and more often.
    assert exact[0] > 0.99 and exact[1] < 0.9 * exact[0] and exact[2] < 0.9 * exact[1]
    with torch.no_grad():
        estimate = ceiling.marginal_acceptance(target, context, 5000, DRAFTS, torch.Generator().manual_seed(0))
    # 5000 blocks: standard error <= 0.007 per position; the estimated marginals add a bias of the same order.
    torch.testing.assert_close(estimate, exact, rtol=0, atol=0.03)


def test_the_script_reports_a_ceiling_on_the_bundled_target(ceiling, tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    args = ["--limit", "1", "--samples", "32", "--block-size", "4", "--context-tokens", "3", "--json", str(out)]
    assert ceiling.main(args) == 0
    report = json.loads(out.read_text())
    acceptance = report["per_position_acceptance"]
    assert len(acceptance) == 3 and all(0 <= x <= 1 for x in acceptance)
    assert acceptance == sorted(acceptance, reverse=True)  # a later draft is accepted only after the earlier ones
    assert report["tau"] == pytest.approx(1 + sum(acceptance))
    assert f"τ {report['tau']:.2f}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ceiling.main(["--samples", "0"])
