"""DSpark's sequential stage: the low-rank Markov chain over a drafted block.

The backbone scores every block position in one parallel pass; the Markov head
then walks the block left to right, adding ``W2 · W1[previous token]`` to each
position's logits so that each draft conditions on the one before it. This is
the only sequential part of a DSpark step and costs one rank-r product per
position.
"""

from collections.abc import Callable

import torch


def markov_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    markov_embed: Callable[[torch.Tensor], torch.Tensor],
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy left-to-right chain over ``base_logits`` ``[B, n, V]``.

    Position j adds the bias of the token before it (the anchor for j = 0) and
    takes the argmax. Returns the drafts ``[B, n]`` (int64) and the Markov
    embeddings of each position's previous token ``[B, n, r]``, which the
    confidence head consumes.
    """
    num_positions = base_logits.shape[1]
    previous = anchor_tokens.long()
    drafts = []
    embeds = []
    for position in range(num_positions):
        embed = markov_embed(previous)
        logits = base_logits[:, position] + markov_bias(embed)
        previous = logits.argmax(dim=-1)
        drafts.append(previous)
        embeds.append(embed)
    return torch.stack(drafts, dim=1), torch.stack(embeds, dim=1)
