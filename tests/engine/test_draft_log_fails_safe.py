# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""``dspark_draft_log`` never takes a server down: a write that fails mid-serve turns the log
off with one warning, and the requests after it are served, losslessly, with drafts."""

import logging

from dspark_fixtures.engine import TinyEngine, dspark_config, run_engine

PROMPTS = ["w12 w7 w300 w41 w5", "w900 w901 w902 w903", "w1 w2 w3", "w500 w42 w42 w7 w8"]
MAX_TOKENS = 24


class Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_write_error_mid_serve_turns_the_log_off_and_serving_goes_on(tiny, tmp_path):
    plain = run_engine(tiny.bigram_target, PROMPTS, MAX_TOKENS, max_num_seqs=4)
    log = tmp_path / "drafts.jsonl"
    configured = tmp_path / "log"  # the configured path: a link, pointed elsewhere mid-serve
    configured.symlink_to(log)
    warnings = Collected()
    logger = logging.getLogger("vllm.v1.spec_decode.dspark.draft_log")
    logger.addHandler(warnings)
    try:
        with TinyEngine(
            tiny.bigram_target,
            dspark_config(tiny.bigram_draft, dspark_draft_log=str(configured)),
            max_num_seqs=4,
        ) as engine:
            runs = [engine.generate(PROMPTS, MAX_TOKENS)]
            logged = log.read_text()
            configured.unlink()
            configured.symlink_to("/dev/full")  # opens, and every write fails (ENOSPC)
            runs.append(engine.generate(PROMPTS, MAX_TOKENS))
            configured.unlink()
            configured.symlink_to(log)  # writable again: the log stays off
            runs.append(engine.generate(PROMPTS, MAX_TOKENS))
    finally:
        logger.removeHandler(warnings)
    for run in runs:
        assert run.token_ids == plain.token_ids
        assert run.drafts > 0 and sum(run.accepted_per_position) > 0
    assert logged.count('"req_id"') > 0 and log.read_text() == logged
    (warning,) = warnings.messages
    assert "No space left on device" in warning and "serving goes on" in warning
