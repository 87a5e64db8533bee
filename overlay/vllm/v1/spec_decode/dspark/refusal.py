# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A refusal of the loaded draft as the last thing a failed start-up prints.

Every refusal of a configuration raises in vLLM's front end as its config validates
(``check_dspark_config``); what only the worker can refuse is the draft it loaded: checkpoint
tensors against the parameters of the draft it built (``check_loaded_draft``, the V4 draft's
strict loader), the reduced vocabulary and the confidence head of the loaded model. vLLM's
multiprocess start-up drops a worker's exception on the way out: the engine core reports only
that a worker failed, and the frontend (``LLM``, ``vllm serve``) only that the engine core did
("See root cause above"), so the one line that names the tensor and the fix ends far above the
last line. The worker that refuses records the message in a private file named by the
engine's ``instance_id``, which every process of one engine shares; the frontend's start-up
(``launch_core_engines``, patched) raises it in place of vLLM's error. An in-process engine
core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) raises the refusal itself, so nothing is recorded.
Only this module's own files are read: created exclusively, never through a link, owned by
this user.
"""

import contextlib
import functools
import glob
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.spec_decode.dspark.field_errors import REFUSAL

logger = init_logger(__name__)

_PREFIX = "dspark-refusal-"
_MAX_BYTES = 65536


def _path(instance_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), _PREFIX + instance_id)


def record_refusal(instance_id: str, message: str) -> None:
    """Keep ``message`` for the frontend. The first rank to refuse wins; a rank that cannot
    write leaves the log line it already wrote as the only record."""
    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        return
    try:
        fd = os.open(
            _path(instance_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
        )
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as note:
        note.write(message)


def records_refusal(load_model: Callable[..., Any]) -> Callable[..., Any]:
    """For a proposer's ``load_model``: a refusal of the loaded draft is logged once more as one
    short line and recorded for the frontend, to reach the last line."""

    @functools.wraps(load_model)
    def load(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return load_model(self, *args, **kwargs)
        except ValueError as error:
            logger.error("%s%s", REFUSAL, error)
            record_refusal(self.vllm_config.instance_id, str(error))
            raise

    return load


def _take(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        message = os.read(fd, _MAX_BYTES).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return message or None


def raise_recorded_refusal(instance_id: str) -> None:
    """Raise the refusal a worker of this engine recorded (a data-parallel rank suffixes the
    id with ``_dp<rank>``), and remove it; return when there is none."""
    base = _path(instance_id)
    for path in [base, *sorted(glob.glob(glob.escape(base) + "_dp*"))]:
        message = _take(path)
        if message:
            raise ValueError(f"{REFUSAL}{message}") from None
