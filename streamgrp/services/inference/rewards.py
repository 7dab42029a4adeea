"""Reward functions for the inference adapters: ``(prompt, completion_ids, text) -> float | None``.

A reward function gets the task's prompt (the dict the dataset gave), the completion's token ids and
the server's text of them; it returns the reward, or None to reject the slot. Name your own with
``--reward module:function``; these are small defaults for smoke runs and demos.
"""

from __future__ import annotations

from typing import Any


def answer_reward(prompt: dict[str, Any], completion_ids: list[int], text: str) -> float | None:
    """1.0 when the prompt's ``answer`` appears in the completion text, else 0.0; 0.0 without an answer."""
    answer = prompt.get("answer")
    if answer is None:
        return 0.0
    return 1.0 if str(answer).strip().lower() in text.lower() else 0.0


def brevity_reward(prompt: dict[str, Any], completion_ids: list[int], text: str) -> float | None:
    """Shorter completions score higher (1 / (1 + tokens / 16)); rejects an empty one."""
    if not completion_ids:
        return None
    return 1.0 / (1.0 + len(completion_ids) / 16.0)
