"""A workdir folder copied into the task's working directory without what its ignore files name, as SkyPilot's
sync leaves it out; and the ignore rules `tandem launch`'s bucket uploads (`bucket_uploads.py`) share.

    python -m services.scheduler.backends.task_workdir SOURCE DEST

Which rules, as SkyPilot reads them: a folder's `.skyignore` when it has one, else its `.gitignore`, in git's
pattern syntax (`pathspec`'s `GitIgnoreSpec`, the `storage` extra). SkyPilot syncs a workdir with rsync's
`dir-merge` filter, so the same file in any subfolder adds its rules for that subfolder, and with
`.gitignore` the repository's `.git/info/exclude` counts too; `.git/` itself is copied, and a link is copied as
a link. Its bucket uploads read only the top folder's rules and leave `.git/` and links out (`files_of`).

The task's script runs this only when the top folder has one of the files (else a plain `cp`, which any image
has); it needs the standard library and `pathspec`. It exits 1 with a line saying why when it cannot copy, which
the script turns into a PRECHECK failure (`expand.workdir_lines`).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

IGNORE_FILES = (".skyignore", ".gitignore")  # the first the top folder has is the one read, as SkyPilot does
GIT_EXCLUDE = Path(".git") / "info" / "exclude"

Ignored = Callable[[Path, bool], bool]  # (path, is a folder) -> left out


def rules_file(folder: Path) -> str:
    """The name of the ignore file that counts for `folder`: `.skyignore` where it has one, else `.gitignore`
    (whether or not there is one)."""
    return next((n for n in IGNORE_FILES if (folder / n).is_file()), IGNORE_FILES[-1])


def _spec(lines: Sequence[str]) -> Any:
    try:
        import pathspec  # noqa: PLC0415 - git's own pattern rules, in the `storage` extra
    except ImportError:
        raise RuntimeError(
            "the folder's .skyignore / .gitignore rules need pathspec: pip install 'tandem[storage]'"
        ) from None
    return pathspec.GitIgnoreSpec.from_lines(lines)


def top_rules(folder: Path) -> Ignored:
    """The top folder's ignore file alone (the bucket uploads' reading)."""
    rules = folder / rules_file(folder)
    if not rules.is_file():
        return lambda _path, _directory: False
    spec = _spec(rules.read_text().splitlines())
    return lambda path, directory: bool(
        spec.match_file(path.relative_to(folder).as_posix() + ("/" if directory else ""))
    )


def files_of(source: Path) -> Iterator[tuple[Path, str]]:
    """Each file of a folder as (path, its name relative to the folder), without `.git/`, links, and what the
    folder's `.skyignore` (else `.gitignore`) names; a file alone as itself. What a bucket upload sends."""
    if source.is_file():
        yield source, source.name
        return
    ignored = top_rules(source)
    for folder, subfolders, names in os.walk(source):
        here = Path(folder)
        subfolders[:] = sorted(d for d in subfolders if d != ".git" and not ignored(here / d, True))
        for name in sorted(names):
            path = here / name
            if path.is_symlink() or not path.is_file() or ignored(path, False):
                continue  # SkyPilot's upload does not follow links
            yield path, path.relative_to(source).as_posix()


def copy_workdir(source: Path, dest: Path) -> int:
    """Copy `source`'s contents into `dest` (over what is there) as SkyPilot's workdir sync does: the ignore
    file in each folder adds its rules for that folder and below. Returns the number of entries left out."""
    name = rules_file(source)
    left_out = 0
    # Per folder, the rules that hold in it: each from the folder that wrote them, matched relative to it.
    scopes: dict[Path, list[tuple[Path, Any]]] = {source: []}
    if name == ".gitignore" and (source / GIT_EXCLUDE).is_file():
        scopes[source].append((source, _spec((source / GIT_EXCLUDE).read_text().splitlines())))
    for folder, subfolders, names in os.walk(source):
        here = Path(folder)
        rules = list(scopes.pop(here))
        if (here / name).is_file():
            rules.append((here, _spec((here / name).read_text().splitlines())))

        def ignored(path: Path, directory: bool, rules: list[tuple[Path, Any]] = rules) -> bool:
            return any(
                spec.match_file(path.relative_to(root).as_posix() + ("/" if directory else ""))
                for root, spec in rules
            )

        target = dest / here.relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        for sub in sorted(subfolders):
            path = here / sub
            if ignored(path, not path.is_symlink()):
                left_out += 1
            elif path.is_symlink():
                _copy_link(path, target / sub)
            else:
                kept.append(sub)
                scopes[path] = rules
        subfolders[:] = kept
        for file in sorted(names):
            path = here / file
            if ignored(path, False):
                left_out += 1
            elif path.is_symlink():
                _copy_link(path, target / file)
            else:
                shutil.copy2(path, target / file)
        shutil.copystat(here, target)
    return left_out


def _copy_link(path: Path, to: Path) -> None:
    if to.is_symlink() or to.is_file():
        to.unlink()
    to.symlink_to(os.readlink(path))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m services.scheduler.backends.task_workdir SOURCE DEST", file=sys.stderr)
        return 2
    source, dest = Path(argv[0]), Path(argv[1])
    try:
        left_out = copy_workdir(source, dest)
    except (OSError, RuntimeError) as exc:
        print(f"[tandem] cannot copy the workdir {source}: {exc}", file=sys.stderr)
        return 1
    if left_out:
        print(f"[tandem] workdir {source}: {left_out} left out by its {rules_file(source)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
