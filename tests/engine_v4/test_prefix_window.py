"""After a prefix-cache hit the ring must be rebuilt from the recomputed tail alone.

The slot of a new request starts empty (its tags are reset on assignment), so the positions the
draft reads, the last ``sliding_window`` ones, must all be recomputed. V1 hits EAGLE-family
requests only at the block-aligned boundaries of ``replay_boundaries`` (one block below the last
full block), so the tail is at least a block long. DeepSeek-V4 runs with blocks of 256 tokens (vLLM
forces it) and W = 128: every hit leaves the whole window to recompute. A block shorter than W
would not, which the check below shows for 64-token blocks.
"""

from vllm.v1.core.kv_cache_coordinator import replay_boundaries

V4_BLOCK_SIZE = 256
WINDOW = 128


def shortest_recomputed_tail(block_size: int, max_prompt: int = 2048) -> int:
    """Fewest positions recomputed before drafting, over prompts longer than the window."""
    return min(
        prompt - max(replay_boundaries(prompt, block_size, use_eagle=True))
        for prompt in range(WINDOW + 1, max_prompt)
    )


def test_deepseek_v4_blocks_leave_the_whole_window_to_recompute():
    assert shortest_recomputed_tail(V4_BLOCK_SIZE) >= WINDOW


def test_a_block_shorter_than_the_window_would_not():
    assert shortest_recomputed_tail(64) < WINDOW
