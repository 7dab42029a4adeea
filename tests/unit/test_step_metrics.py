import math

import pytest
import torch

from streamgrp.train.step_metrics import MAX_KEYS, checked_metrics


def test_numbers_booleans_text_and_one_element_tensors_are_recorded_as_plain_values():
    recorded = checked_metrics({"loss": torch.tensor(0.25), "tokens": 12, "clipped": False, "note": "warm-up"})
    assert recorded == {"loss": 0.25, "tokens": 12, "clipped": False, "note": "warm-up"}
    assert type(recorded["loss"]) is float


@pytest.mark.parametrize(
    "values, message",
    [
        ({"loss": math.nan}, "'loss' is nan: record finite numbers"),
        ({"loss": float("inf")}, "record finite numbers"),
        ({"loss": None}, "'loss' is NoneType"),
        ({"shape": [1, 2]}, "'shape' is list"),
        ({"note": "x" * 300}, "text of at most 256"),
        ({"": 1.0}, "give text of 1 to 64"),
        ({"step": 3}, "'step' is recorded with every step"),
        ({f"k{i}": i for i in range(MAX_KEYS + 1)}, "record at most 64"),
    ],
)
def test_what_cannot_be_recorded_is_refused_naming_the_key(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        checked_metrics(values)
