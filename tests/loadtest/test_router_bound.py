"""The router bound's arithmetic: an answer stays the large model's exactly when every
position where the small model disagrees is routed to the large model."""

import pytest
import torch

from loadtest.router_bound import bound_table, entropy_scores


def test_an_answer_is_kept_only_when_all_its_disagreements_are_routed() -> None:
    # item 0: positions 0-2, disagreement at 1 (score 0.9); item 1: positions 3-5,
    # disagreements at 3 (0.8) and 5 (0.1); item 2: positions 6-7, none.
    scores = torch.tensor([0.2, 0.9, 0.3, 0.8, 0.4, 0.1, 0.5, 0.6])
    disagree = torch.tensor([0, 1, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    item_of = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    correct = torch.tensor([True, True, False])
    low, high = bound_table(scores, disagree, item_of, correct, shares=(0.25, 1.0))
    assert low["share"] == 0.25  # 0.9 and 0.8 routed
    assert low["recall"] == pytest.approx(2 / 3)
    assert low["exact"] == pytest.approx(2 / 3)  # items 0 and 2; item 1 misses position 5
    assert low["accuracy"] == pytest.approx(1 / 3)  # item 2 is exact but wrong
    assert high == pytest.approx({"share": 1.0, "recall": 1.0, "exact": 1.0, "accuracy": 2 / 3})


def test_entropy_is_highest_for_a_flat_distribution() -> None:
    flat, peaked = entropy_scores(torch.tensor([[1.0, 1.0, 1.0], [9.0, 0.0, 0.0]]))
    assert abs(float(flat) - float(torch.log(torch.tensor(3.0)))) < 1e-6
    assert float(peaked) < 0.01
