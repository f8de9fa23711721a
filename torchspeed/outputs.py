"""Output folders that never replace a user's files.

A folder torchspeed writes into (`train --out`, `optimize --out`, `prune --out`, a report directory)
is either new, or one torchspeed made: it carries a marker file listing the names torchspeed wrote
there. Anything else in the folder is the user's, and its presence refuses the folder (naming one such
file) whatever `overwrite` says; `overwrite` only allows replacing what torchspeed wrote. The folder is
checked, and its writability tried, before any measuring, so a bad `--out` costs nothing.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from torchspeed.atomic import write_json

__all__ = ["MARKER", "OutputDir", "claim_output_dir", "check_output_file", "is_temporary"]

MARKER = ".torchspeed-output.json"


@dataclass(frozen=True)
class OutputDir:
    """A folder torchspeed may write into; `record` adds names it wrote to the folder's marker."""

    path: str
    kind: str

    def written(self) -> list[str]:
        """The names torchspeed recorded as its own in this folder."""
        return _read_marker(self.path) or []

    def record(self, *names: str) -> None:
        """Mark `names` (entries directly in the folder) as torchspeed's, so a later run may replace them."""
        known = self.written()
        new = [n for n in names if n not in known]
        if new:
            write_json(os.path.join(self.path, MARKER), {"kind": self.kind, "written": sorted([*known, *new])})

    def holds(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.path, name))


def _read_marker(path: str) -> list[str] | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past the interpreter's limit
        return None
    written = data.get("written") if isinstance(data, dict) else None
    if not isinstance(written, list) or not all(isinstance(n, str) for n in written):
        return None
    return written


def check_output_file(path: str | os.PathLike, flag: str = "--json") -> None:
    """Before any work: the file `path` can be written (its folder is created and a file tried there;
    nothing is left behind). ValueError for a folder, OSError for an unwritable place, naming `flag`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder: give a file path such as {os.path.join(path, 'result.json')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OSError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def is_temporary(name: str) -> bool:
    """torchspeed's own temporaries (an atomic write's `.NAME.XXXX.tmp`, a save's partial folder): an
    interrupted save may leave one, and the writers clean those of dead processes themselves."""
    return name.startswith(".torchspeed-") or (name.startswith(".") and name.endswith(".tmp"))


def claim_output_dir(path: str | os.PathLike, kind: str, *, overwrite: bool = False, flag: str = "--out",
                     replaces: tuple[str, ...] = ()) -> OutputDir:
    """Check and create the output folder `path` for a `kind` of output (e.g. "optimize"), before any work.

    Refused with ValueError naming the file: a folder holding anything torchspeed did not write there.
    Refused unless `overwrite`: a folder where torchspeed already wrote one of `replaces` (the names
    this output is about to write). OSError with one line when the folder cannot be created or written.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a folder: give a folder path")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # can files be created there? (nothing is left behind)
            pass
    except OSError as e:
        raise OSError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    present = sorted(n for n in os.listdir(path) if n != MARKER and not is_temporary(n))
    ours = _read_marker(path) or []
    foreign = [n for n in present if n not in ours]
    if foreign:
        raise ValueError(f"{flag} {path!r} holds files torchspeed did not write (e.g. {foreign[0]!r}); they are "
                         f"never replaced: give a new or empty folder")
    clash = [n for n in replaces if n in present]
    if clash and not overwrite:
        raise ValueError(f"{flag} {path!r} already holds {clash[0]!r} from an earlier run: pass --overwrite to "
                         "replace it, or give another folder")
    out = OutputDir(path, kind)
    if not os.path.exists(os.path.join(path, MARKER)):
        write_json(os.path.join(path, MARKER), {"kind": kind, "written": ours})
    return out
