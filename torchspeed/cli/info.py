"""`torchspeed info`: the machine as torchspeed sees it."""
from __future__ import annotations

import argparse

from torchspeed.cli import add_json_option


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="describe this machine (CPU, ISA, GPU, library versions, default precision)")
    add_json_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torchspeed.tables import print_table
    from torchspeed.runtime import default_precision, describe

    info = describe()
    info["default_precision"] = default_precision().to_dict()
    rows = [(k, v) for k, v in info.items() if k not in ("isa", "gpus", "default_precision")]
    rows.append(("isa", ", ".join(k for k, v in info["isa"].items() if v) or "-"))
    rows.append(("gpus", "; ".join(f"{g['name']} (sm {g['capability']})" for g in info["gpus"]) or "none"))
    rows.append(("default precision", f"{info['default_precision']['name']}: {info['default_precision']['reason']}"))
    print_table("This machine", ["what", "value"], rows)
    if args.json:
        from torchspeed.atomic import write_json

        write_json(args.json, info)
    return 0
