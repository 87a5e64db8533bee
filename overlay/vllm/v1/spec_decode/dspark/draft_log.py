"""``dspark_draft_log``: every step's drafts per request, one JSON line each (debug only)."""

import json

import torch


def append_draft_log(
    path: str,
    req_ids: list[str],
    anchors: torch.Tensor,
    anchor_tokens: torch.Tensor,
    drafts: torch.Tensor,
) -> None:
    """Append one record per request: its id, the last context position before the block
    (``anchors``), the token the block starts from and the drafts. Copies to the host."""
    rows = zip(req_ids, anchors.tolist(), anchor_tokens.tolist(), drafts.tolist(), strict=True)
    with open(path, "a") as log:
        for req_id, anchor, anchor_token, block in rows:
            record = {"req_id": req_id, "anchor": anchor, "anchor_token": anchor_token}
            log.write(json.dumps({**record, "drafts": block}) + "\n")
