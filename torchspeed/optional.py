"""Optional libraries, imported on first use with one error that names the extra to install.

The heavy or optional libraries a code path needs (OpenVINO, ONNX Runtime, DALI, matplotlib, lmdb,
pyarrow, ...) are imported through `optional(...)` where they are used, never at the top of a module:
importing torchspeed must not pay for them nor fail without them. OpenVINO and NNCF start a telemetry
process on import unless told they run in CI: they are imported with CI=true / NNCF_CI=1 set only
during the import (`runtime.import_as_found`), so the user's own settings stay as they were.
"""
from __future__ import annotations

from types import ModuleType

from torchspeed.runtime import import_as_found

__all__ = ["optional", "OPENVINO_NO_TELEMETRY"]

OPENVINO_NO_TELEMETRY = {"CI": "true", "NNCF_CI": "1"}


def optional(module: str, install: str, needed_for: str) -> ModuleType:
    """`module`, imported now (the caller's process left as found), or an ImportError saying what needs it
    and how to install it: `install` is an extra of torchspeed ("infer": pip install 'torchspeed[infer]')
    or, with a space in it, the whole command ("pip install lightning")."""
    env = OPENVINO_NO_TELEMETRY if module.split(".")[0] in ("openvino", "nncf") else None
    try:
        return import_as_found(module, env)
    except ImportError as e:
        how = install if " " in install else f"pip install 'torchspeed[{install}]'"
        raise ImportError(f"{needed_for} needs {module} ({e}): {how}") from None
