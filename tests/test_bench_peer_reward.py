"""bench/peer_reward.py (the TRL peer's copy of the reward) scores as toolrl's gen worker does."""
import importlib.util
from pathlib import Path

import pytest

from toolrl.config import RewardConfig
from toolrl.worker.rewards import Completion, score

_PATH = Path(__file__).resolve().parent.parent / "bench" / "peer_reward.py"
_spec = importlib.util.spec_from_file_location("peer_reward", _PATH)
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

WEIGHTS = {"correct": 1.0, "format": 0.2}
# (completion text with the prefill in front, ground truth): what SmolLM2 writes, right and wrong
CASES = [
    ("<think>\n48 times 36 is 1728.\n</think>\n<answer>\n\\boxed{1728}\n</answer>", "1728"),
    ("<think>\n48 times 36 is 1728.\n</think>\n<answer>\n\\boxed{1729}\n</answer>", "1728"),
    ("<think>\nso\n</think>\n<answer>\nThe total is \\boxed{1,728}.\n</answer>\n", "1728"),
    ("<think>\nso\n</think>\n<answer>\n\\boxed{1728.0}\n</answer>", "1728"),
    ("<think>\nso\n</think>\n<answer>\n\\boxed{ 1728 }\n</answer>", "1728"),
    ("<think>\n\\boxed{1728}\n</think>\n<answer>\n\\boxed{99}\n</answer>", "1728"),
    ("<think>\nthe answer is \\boxed{1728}", "1728"),  # cut off at the token limit
    ("<think>\nx\n</think>\n<answer>1728</answer>", "1728"),  # no box
    ("<think>\nx\n</think> and then <answer>\\boxed{1728}</answer>", "1728"),  # text between the blocks
    ("<think>\nx\n</think>\n<answer>\\boxed{1728}</answer>\nMore text.", "1728"),  # text after
    ("<think>\nx\n</think>\n<answer>\\boxed{12}</answer><answer>\\boxed{1728}</answer>", "1728"),
    ("<think>\nx\n</think>\n<answer>\\boxed{\\frac{3456}{2}}</answer>", "1728"),  # a calculation: 0
    ("<think>\nx\n</think>\n<answer>\\boxed{48 \\times 36}</answer>", "1728"),
    ("<think>\nx\n</think>\n<answer>\\boxed{}</answer>", "1728"),
    ("<think>\nx\n</think>\n<answer>\\boxed{-5}</answer>", "-5"),
    ("", "1728"),
]


@pytest.mark.parametrize("text,answer", CASES)
def test_peer_reward_agrees_with_toolrl(text, answer):
    ours = score(Completion(text=text, final_text=text), answer, RewardConfig(weights=WEIGHTS))
    theirs = peer.score(text, answer, WEIGHTS)
    assert theirs == ours


def test_peer_reward_refuses_a_reward_it_does_not_implement():
    with pytest.raises(ValueError, match="digit"):
        peer.score("x", "1", {"correct": 1.0, "digit": 1.0})
