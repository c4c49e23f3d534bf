"""Which checkpoints a run keeps, and whose checkpoints it may touch.

Lineage: every manifest and payload records the lineage (a random id) of the manager that
wrote it; restoring a payload adopts its lineage. Retention and ``discard_after`` count and
delete only checkpoints of the run's own lineage: another run's checkpoints in the same
directory are never deleted (``foreign_warning`` names them once), except that a save at the
same step replaces the file of that name.

Deletion always removes the manifest first, so a half-deleted checkpoint is never taken for
verified. Callers hold the manager's directory lock.
"""

from __future__ import annotations

from pathlib import Path

from agent.checkpoints.format import (
    CheckpointInfo,
    data_files,
    manifest_path,
    read_manifests,
)


def retained_steps(
    infos: list[CheckpointInfo],
    *,
    keep_last: int,
    keep_known_good: int,
    known_good_spacing: int,
    protect_before_step: int | None,
) -> set[int]:
    """The steps to keep among one lineage's checkpoints: the last ``keep_last``; the newest
    known-good one; ``keep_known_good`` spaced known-good ones (the oldest known-good
    checkpoint of each of the newest ``known_good_spacing``-step buckets that have one: a
    choice that does not change as newer checkpoints arrive; spacing 0: simply the newest
    known-good ones); and the newest known-good one before ``protect_before_step``."""
    infos = sorted(infos, key=lambda i: i.step, reverse=True)
    keep = {i.step for i in infos[:keep_last]}
    known_good = [i for i in infos if i.known_good]  # newest first
    if known_good:
        keep.add(known_good[0].step)
    if known_good_spacing > 0:
        oldest_in_bucket: dict[int, int] = {}
        for info in known_good:  # newest first: the last write per bucket is its oldest
            oldest_in_bucket[info.step // known_good_spacing] = info.step
        spaced = [oldest_in_bucket[b] for b in sorted(oldest_in_bucket, reverse=True)]
    else:
        spaced = [i.step for i in known_good]
    keep.update(spaced[:keep_known_good])
    if protect_before_step is not None:
        older = [i for i in known_good if i.step < protect_before_step]
        if older:
            keep.add(older[0].step)
    return keep


def apply_retention(
    directory: Path,
    lineage: str,
    *,
    keep_last: int,
    keep_known_good: int,
    known_good_spacing: int,
    protect_before_step: int | None,
) -> None:
    """Delete the lineage's checkpoints that ``retained_steps`` does not keep, then every data
    file without a readable manifest (it can never be verified)."""
    own = [i for i in read_manifests(directory) if i.lineage == lineage]
    keep = retained_steps(
        own,
        keep_last=keep_last,
        keep_known_good=keep_known_good,
        known_good_spacing=known_good_spacing,
        protect_before_step=protect_before_step,
    )
    for info in own:
        if info.step not in keep:
            info.manifest_path.unlink(missing_ok=True)
            info.path.unlink(missing_ok=True)
    described = {i.step for i in read_manifests(directory)}
    for step, path in data_files(directory):
        if step not in described:
            manifest_path(directory, step).unlink(missing_ok=True)
            path.unlink(missing_ok=True)


def discard_after(directory: Path, lineage: str, step: int) -> list[int]:
    """Delete the lineage's checkpoints newer than ``step``, and data files newer than it that
    have no readable manifest; another lineage's stay. Returns the deleted steps, sorted."""
    deleted = []
    infos = read_manifests(directory)
    foreign = {i.step for i in infos if i.lineage != lineage}
    for info in infos:
        if info.step > step and info.lineage == lineage:
            info.manifest_path.unlink(missing_ok=True)
            deleted.append(info.step)
    for s, path in data_files(directory):
        if s > step and s not in foreign:
            path.unlink(missing_ok=True)
            deleted.append(s)
    return sorted(set(deleted))


def foreign_warning(directory: Path, lineage: str) -> str | None:
    """A warning naming the checkpoints in ``directory`` that another lineage wrote, or None."""
    foreign = sorted(i.step for i in read_manifests(directory) if i.lineage != lineage)
    if not foreign:
        return None
    return (
        f"{len(foreign)} checkpoint(s) in {directory} were written by another run "
        f"(steps {foreign[:10]}{' ...' if len(foreign) > 10 else ''}): they are never "
        "rolled back to and never deleted by this run, except that a save at the same "
        "step replaces that file; use a new directory per run, or restore one of them to "
        "continue that run"
    )
