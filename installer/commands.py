# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The installer's modes: install, dry run, status and uninstall, each under the tree lock.

Every mode except the dry run first repairs what a killed run left behind, so a half-patched
tree never goes unnoticed.
"""

import dataclasses
import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from installer import manifest as manifest_module
from installer import pins as pins_module
from installer.errors import ExitCode, InstallerError, Refused, RollbackFailed
from installer.manifest import Manifest
from installer.plan import REINSTALL_ADVICE, Plan, plan_install, plan_uninstall
from installer.state import StateStore
from installer.status import NOT_INSTALLED, Status, evaluate
from installer.torch_builds import check_torch_companions
from installer.transaction import commit, recover
from installer.vllm_tree import VllmTree


def install(tree: VllmTree, project: Path, dry_run: bool) -> ExitCode:
    manifest = load_manifest(tree, project)
    check_torch_companions(tree.root)
    store = StateStore(tree.root)
    with tree_lock(tree):
        _note(tree.record_check_skipped(list(manifest.patched_targets())))
        if dry_run:
            if store.read_journal() is not None:
                raise InstallerError(
                    "an interrupted run left a journal in this tree; run `install.py --status` "
                    "to repair it before a dry run. Nothing was changed."
                )
            _print_plan(plan_install(tree, manifest, store), dry_run=True)
            print("dry run: nothing was changed")
            return ExitCode.OK
        _repair(tree, store)
        plan = plan_install(tree, manifest, store)
        if not plan.changes:
            print(f"DSpark is already installed in vLLM {tree.version}; nothing was written")
        else:
            commit(tree, store, plan, "install")
            _print_plan(plan, dry_run=False)
            print(
                f"installed dspark-vllm {manifest.project_version} into vLLM {tree.version} at "
                f"{tree.package_dir}"
            )
        status = evaluate(tree, manifest, store.read_record(), interrupted=False)
        print(f"digest: {status.digest}")
        return status.exit_code


def uninstall(tree: VllmTree, project: Path, force: bool) -> ExitCode:
    version_pins = _pins_if_supported(tree, project)
    store = StateStore(tree.root)
    with tree_lock(tree):
        _repair(tree, store)
        if store.read_record() is None:
            _refuse_unrecorded_changes(tree, project)
            print(f"DSpark is not installed in vLLM {tree.version}; nothing was written")
            return ExitCode.OK
        plan = plan_uninstall(tree, store, version_pins, force)
        record = store.read_record()
        assert record is not None
        _note(tree.record_check_skipped([f.path for f in record.files if f.kind == "patch"]))
        commit(tree, store, plan, "uninstall")
        _print_plan(plan, dry_run=False)
        print(f"uninstalled DSpark: vLLM {tree.version} is back to its original files")
        return ExitCode.OK


def status(tree: VllmTree, project: Path) -> Status:
    """Repairs a killed run first when it can; when it cannot (e.g. a read-only tree), the
    state is "partial" and a note says why."""
    manifest = load_manifest(tree, project)
    store = StateStore(tree.root)
    with tree_lock(tree):
        try:
            _repair(tree, store)
            failure: tuple[str, ...] = ()
        except RollbackFailed as error:
            failure = (str(error),)
        status = evaluate(
            tree, manifest, store.read_record(), interrupted=store.read_journal() is not None
        )
        skipped = tree.record_check_skipped(list(manifest.patched_targets()))
        return dataclasses.replace(
            status, notes=status.notes + failure + ((skipped,) if skipped else ())
        )


def load_manifest(tree: VllmTree, project: Path) -> Manifest:
    pins = pins_module.load(project)
    version_pins = pins.for_tree(
        tree.version, tree.dist_info.name if tree.dist_info else None, tree.has_v1_runner
    )
    return manifest_module.build(project, pins, version_pins)


@contextmanager
def tree_lock(tree: VllmTree) -> Iterator[None]:
    """An exclusive flock on the vllm package directory itself: needs no write access and is
    released by the kernel when a run dies."""
    descriptor = os.open(tree.package_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InstallerError(
                f"another install.py run holds the lock on {tree.package_dir}; wait for it to "
                f"finish, then run again. Nothing was changed."
            ) from None
        yield
    finally:
        os.close(descriptor)


def _pins_if_supported(tree: VllmTree, project: Path) -> pins_module.VersionPins | None:
    """Uninstall works from the record alone, so a version the project dropped can be undone."""
    pins = pins_module.load(project)
    try:
        return pins.for_tree(tree.version, tree.dist_info.name if tree.dist_info else None)
    except InstallerError:
        return None


def _refuse_unrecorded_changes(tree: VllmTree, project: Path) -> None:
    """Without a record there are no saved originals: files that are not vLLM's own can only be
    restored by reinstalling vLLM."""
    try:
        manifest = load_manifest(tree, project)
    except InstallerError:
        return  # a version this checkout does not pin: nothing it could have installed
    changed = [
        file.path
        for file in evaluate(tree, manifest, None, interrupted=False).files
        if file.state != NOT_INSTALLED
    ]
    if changed:
        raise Refused(
            f"DSpark has no install record in this tree, but these files are not vLLM's "
            f"originals: {', '.join(changed)}. Nothing was changed. {REINSTALL_ADVICE}"
        )


def _repair(tree: VllmTree, store: StateStore) -> None:
    repaired = recover(tree, store)
    if repaired:
        print(repaired, file=sys.stderr)


def _note(note: str | None) -> None:
    if note:
        print(f"note: {note}", file=sys.stderr)


def _print_plan(plan: Plan, dry_run: bool) -> None:
    for change in plan.changes:
        print(f"  {change.describe()}")
    print(f"{'would change' if dry_run else 'changed'} {len(plan.changes)} file(s)")
