"""`torchspeed info`: the machine as torchspeed sees it: CPU and ISA, GPU, libraries, usable JPEG decoders and inference runtimes."""
from __future__ import annotations

import argparse
from typing import Any

from torchspeed.cli import add_json_option

# (what it is for, distribution names to look for): versions come from package metadata, nothing is imported
LIBRARIES = (
    ("torchvision", ("torchvision",)), ("numpy", ("numpy",)), ("pillow", ("pillow",)), ("lmdb", ("lmdb",)),
    ("simplejpeg", ("simplejpeg",)), ("opencv", ("opencv-python-headless", "opencv-python")), ("onnx", ("onnx",)),
    ("onnxruntime", ("onnxruntime", "onnxruntime-gpu")), ("openvino", ("openvino",)), ("nncf", ("nncf",)),
    ("torchao", ("torchao",)), ("torch-pruning", ("torch-pruning",)), ("timm", ("timm",)),
    ("matplotlib", ("matplotlib",)), ("rich", ("rich",)),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="describe this machine (CPU, ISA, GPU, library versions, usable JPEG decoders and inference runtimes, "
                                    "default precision)")
    add_json_option(p)
    p.set_defaults(func=run)


def library_versions() -> dict[str, str | None]:
    """Each optional library's installed version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name, dists in LIBRARIES:
        out[name] = None
        for dist in dists:
            try:
                out[name] = version(dist) + ("" if dist == dists[0] else f" ({dist})")
                break
            except PackageNotFoundError:
                continue
    return out


def _usable(names: dict[str, str | None]) -> str:
    usable = [name for name, why in names.items() if why is None]
    return ", ".join(usable) or "none"


def run(args: argparse.Namespace) -> int:
    from torchspeed.data import available_decoders
    from torchspeed.infer import available_runtimes
    from torchspeed.runtime import default_precision, describe
    from torchspeed.tables import print_table

    info: dict[str, Any] = describe()
    info["default_precision"] = default_precision().to_dict()
    info["libraries"] = library_versions()
    info["decoders"] = available_decoders()
    info["runtimes"] = available_runtimes()
    shown = {k: v for k, v in info.items()
             if k not in ("isa", "isa_caps", "gpus", "default_precision", "libraries", "decoders", "runtimes")}
    rows = [(k, "none" if v is None else v) for k, v in shown.items()]
    rows.append(("isa", ", ".join(k for k, v in info["isa"].items() if v) or "-"))
    rows.append(("isa caps", ", ".join(f"{k}={v}" for k, v in info["isa_caps"].items()) or "none"))
    rows.append(("gpus", "; ".join(f"{g['name']} (sm {g['capability']})" for g in info["gpus"]) or "none"))
    rows.append(("default precision", f"{info['default_precision']['name']}: {info['default_precision']['reason']}"))
    rows += [("JPEG decoders (data)", _usable(info["decoders"])), ("inference runtimes", _usable(info["runtimes"]))]
    print_table("This machine", ["what", "value"], rows)
    print_table("Libraries", ["library", "version"],
                [(name, v or "not installed") for name, v in info["libraries"].items()])
    if args.json:
        from torchspeed.atomic import write_json

        write_json(args.json, info)
    return 0
