# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Commit a plan all-or-nothing, roll it back, and repair after a killed run.

Order of a commit: save the previous bytes of every touched file as blobs, write the journal,
replace the files one by one (record last), verify every hash, byte-compile, prune directories,
and remove the journal: that removal is the commit point. Until then the journal lets any later
run restore every file to its previous bytes.
"""

import contextlib
import errno
import os

from installer.errors import InstallerError, RollbackFailed
from installer.faults import checkpoint
from installer.fileops import (
    compile_python,
    prune_dirs,
    remove,
    replace_with_symlink,
    temp_path,
    write_atomic,
)
from installer.hashing import sha256_hex
from installer.plan import Plan
from installer.state import JOURNAL, Journal, JournalEntry, StateStore
from installer.vllm_tree import VllmTree


class VerificationError(Exception):
    """A file does not hold the bytes the transaction just wrote or restored."""


def commit(tree: VllmTree, store: StateStore, plan: Plan, operation: str) -> None:
    try:
        for change in plan.changes:
            if change.before is not None:
                store.put_blob(change.before)
                checkpoint(f"original of {change.path} saved")
        journal = Journal(
            operation,
            tuple(
                JournalEntry(
                    change.path, _hash(change.before), _hash(change.after), change.before_link
                )
                for change in plan.changes
            ),
            plan.new_dirs,
        )
        store.write_journal(journal)
        checkpoint("journal written")
    except OSError as error:
        _sweep(store)
        if error.errno == errno.ENOSPC:
            advice = f"Free space on the file system that holds {tree.package_dir}"
        else:
            advice = f"Run install.py as a user who can write to {tree.package_dir}"
        raise InstallerError(
            f"cannot write into the vLLM tree ({_describe(error)}). {advice}. Nothing was changed."
        ) from error
    doing = "starting"
    try:
        for change in plan.changes:
            doing = f"writing {change.path}"
            if change.after_link is not None:
                replace_with_symlink(tree.path(change.path), change.after_link)
            elif change.after is None:
                remove(tree.path(change.path))
            else:
                write_atomic(tree.path(change.path), change.after)
            checkpoint(f"{change.path} replaced")
        doing = "verifying the written files"
        _verify(tree, journal, "after_sha256")
        for change in plan.changes:
            if change.kind != "record" and change.after is not None:
                doing = f"byte-compiling {change.path}"
                compile_python(tree.path(change.path))
                checkpoint(f"{change.path} compiled")
        doing = "removing directories the previous install created"
        prune_dirs([tree.path(path) for path in plan.stale_dirs])
        checkpoint("stale directories removed")
    except (Exception, KeyboardInterrupt) as error:
        failure = f"{operation} failed while {doing}: {_describe(error)}"
        try:
            rollback(tree, store, journal)
        except RollbackFailed as rollback_error:
            # The first error is the one to fix; the rollback's own failure comes second.
            raise RollbackFailed(f"{failure}; then {rollback_error}") from error
        raise InstallerError(
            f"{failure}. Every change was rolled back and verified; the vLLM tree is exactly as "
            f"before."
        ) from error
    store.remove_journal()
    checkpoint("journal removed")
    _sweep(store)


def recover(tree: VllmTree, store: StateStore) -> str | None:
    """Roll back a transaction a killed run left behind; say what was repaired, if anything."""
    journal = store.read_journal()
    if journal is not None:
        rollback(tree, store, journal)
    _sweep(store)
    if journal is None:
        return None
    return f"repaired an interrupted {journal.operation}: the tree is back to its state before it"


def rollback(tree: VllmTree, store: StateStore, journal: Journal) -> None:
    try:
        for entry in reversed(journal.entries):
            path = tree.path(entry.path)
            temp_path(path).unlink(missing_ok=True)
            current = tree.read(entry.path)
            if entry.before_sha256 is None:
                if current is not None:
                    remove(path)
            elif entry.before_link is not None:
                if not path.is_symlink() or os.readlink(path) != entry.before_link:
                    replace_with_symlink(path, entry.before_link)
            elif current is None or sha256_hex(current) != entry.before_sha256:
                # No byte-compiling here: the stale .pyc no longer matches the source's mtime,
                # so Python recompiles it on import.
                write_atomic(path, store.get_blob(entry.before_sha256))
            checkpoint(f"{entry.path} restored")
        _verify(tree, journal, "before_sha256")
        prune_dirs([tree.path(path) for path in journal.new_dirs])
        store.remove_journal()
        checkpoint("rollback journal removed")
    except (OSError, VerificationError, KeyboardInterrupt) as error:
        raise RollbackFailed(
            f"rolling back the {journal.operation} failed: {_describe(error)}. The journal "
            f"{tree.path(JOURNAL)} is kept: fix the cause and run `install.py --status` to retry "
            f"the repair, or reinstall vLLM with `pip install --force-reinstall --no-deps` and "
            f"delete {store.directory} and the overlay files its record lists."
        ) from error
    _sweep(store)


def _verify(tree: VllmTree, journal: Journal, side: str) -> None:
    for entry in journal.entries:
        expected = getattr(entry, side)
        actual = _hash(tree.read(entry.path))
        if actual != expected:
            raise VerificationError(f"{entry.path} has sha256 {actual}, expected {expected}")


def _sweep(store: StateStore) -> None:
    # Leftovers in the state directory are harmless and swept by the next run.
    with contextlib.suppress(OSError):
        store.collect_garbage()


def _hash(data: bytes | None) -> str | None:
    return None if data is None else sha256_hex(data)


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"the disk is full ({error.strerror or 'No space left on device'}: {error.filename})"
    if isinstance(error, OSError) and error.filename:
        return f"{error.strerror or error} ({error.filename})"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return str(error) or type(error).__name__
