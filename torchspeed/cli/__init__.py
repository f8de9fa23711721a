"""The `torchspeed` command. Thin: parses, calls the library, prints.

Each area registers its subcommands from its own module (`torchspeed/cli/<area>.py`). Nothing here
imports torch: `--help` and `--version` stay instant; commands import what they need when they run.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence

from torchspeed import __version__
from torchspeed.args import SECONDS_RULE, positive_number
from torchspeed.deprecated import FLAGS

# Modules that define `register(subparsers)`; order is the order of `--help`.
COMMAND_MODULES = ("data", "train", "infer", "compress", "doctor", "bench", "info")


class UserError(Exception):
    """A problem with the user's input: printed as one line, no traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchspeed",
        description="Make PyTorch training and inference fast on this machine, and prove it by measurement.",
    )
    parser.add_argument("--version", action="version", version=f"torchspeed {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true",
                           help="show every measured choice as it is made (the default for all commands but bench)")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="show warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMAND_MODULES:
        importlib.import_module(f"torchspeed.cli.{name}").register(sub)
    return parser


def error(message: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    message = " ".join(line.strip() for line in str(message).splitlines() if line.strip())  # one line
    # soft_wrap: one line whatever the width (piped, COLUMNS unset, rich would wrap at 80 columns)
    Console(stderr=True, soft_wrap=True).print(f"[bold red]torchspeed: error:[/] {escape(message)}", highlight=False,
                                               markup=True)
    return 2


# How torch says a machine's limit was reached: its allocators and its file writer raise RuntimeError
# (never MemoryError or OSError), the writer's "unexpected pos" being a write that failed, e.g. on a full disk.
_NO_MEMORY = ("can't allocate memory", "out of memory", "not enough memory", "failed to allocate")
_NO_DISK = ("unexpected pos", "PytorchStreamWriter failed", "No space left on device", "Disk quota exceeded")


def machine_limit(e: BaseException) -> str | None:
    """One line for memory or disk running out (MemoryError, or the RuntimeError torch raises for it),
    saying what to do; None for any other error (a bug: its traceback is shown)."""
    text = str(e)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    first = first.split("] ", 1)[1] if first.startswith("[enforce fail at") and "] " in first else first
    if isinstance(e, MemoryError) or any(w in text for w in _NO_MEMORY):
        return (f"out of memory ({first[:200]}): give a smaller --input-shape or --batch-size, or a smaller model, "
                "or free memory")
    if any(w in text for w in _NO_DISK):
        return (f"a file could not be written ({first[:200]}): the disk is full or over quota? free space (what "
                "torchspeed wrote before stays whole)")
    return None


def positive_float(unit: str | None = "seconds") -> Callable[[str], float]:
    """argparse type: a finite number above 0 (nan and inf refused: `args.positive_number`)."""
    def parse(text: str) -> float:
        try:
            return positive_number(float(text), "", unit)
        except ValueError:
            of = f" of {unit}" if unit else ""
            rule = SECONDS_RULE if unit == "seconds" else f"expected a positive, finite number{of}"
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}") from None

    return parse


class _LogHandler(logging.Handler):
    """torchspeed's log lines on stderr (stdout stays for tables and `--json -`)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"torchspeed: {self.format(record)}\n")
        except Exception:  # noqa: BLE001 -- logging must never break the command
            self.handleError(record)


def _log_to_stderr(args: argparse.Namespace) -> tuple[logging.Handler, int]:
    """Show the "torchspeed" logger's lines while a command runs; no other logger is touched.
    Returns the handler and the logger's previous level, for `main` to restore."""
    level = logging.INFO if args.verbose else logging.WARNING if args.quiet else getattr(args, "log_level", logging.INFO)
    logger = logging.getLogger("torchspeed")
    previous = logger.level
    handler = _LogHandler(level)
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler, previous


def main(argv: Sequence[str] | None = None) -> int:
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a native crash (segfault in a runtime) prints where it happened
    parser = build_parser()
    args = parser.parse_args(_renamed_flags(sys.argv[1:] if argv is None else list(argv)))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    handler, previous_level = _log_to_stderr(args)
    json_to_stdout = getattr(args, "json", None) == "-"
    if json_to_stdout:  # the command writes its JSON to a temporary file; stdout gets it alone at the end
        fd, args.json = tempfile.mkstemp(prefix="torchspeed-", suffix=".json")
        os.close(fd)
        os.unlink(args.json)
    try:
        if getattr(args, "json", None) and not json_to_stdout:
            from torchspeed.outputs import check_output_file

            check_output_file(args.json, "--json")
        with contextlib.redirect_stdout(sys.stderr) if json_to_stdout else contextlib.nullcontext():
            status = int(args.func(args) or 0)
        if json_to_stdout and os.path.exists(args.json):
            with open(args.json, encoding="utf-8") as f:
                sys.stdout.write(f.read())
            sys.stdout.flush()
        return 128 - status if status < 0 else status  # a child killed by signal N: 128 + N, as the shell says
    except KeyboardInterrupt:
        error("interrupted")
        return 130  # 128 + SIGINT, as the shell reports Ctrl-C
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError,
            pickle.UnpicklingError) as e:
        if args.debug:
            raise
        return error(str(e))
    except OSError as e:
        if args.debug:
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return error(f"{e.strerror or e}{where}")
    except (RuntimeError, MemoryError) as e:
        line = machine_limit(e)
        if line is None or args.debug:
            raise
        return error(line)
    finally:
        logging.getLogger("torchspeed").removeHandler(handler)
        logging.getLogger("torchspeed").setLevel(previous_level)
        if json_to_stdout and os.path.exists(args.json):
            os.unlink(args.json)


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer >= `minimum` (`what` names it in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")


def fraction(low_inclusive: bool = False):
    """argparse type: a number in (0, 1), or [0, 1) with `low_inclusive`."""
    interval = "[0, 1)" if low_inclusive else "(0, 1)"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text!r}") from None
        if not (0 <= value if low_inclusive else 0 < value) or not value < 1:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text!r}")
        return value

    return parse


def int_tuple(text: str) -> tuple[int, ...]:
    """argparse type: '1,3,224,224' -> (1, 3, 224, 224)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,3,224,224, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every dimension must be >= 1, got {text!r}")
    return values


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model-kwargs and --weights: the options every command that builds a model by spec shares."""
    p.add_argument("--model-kwargs", metavar="JSON",
                   help="keyword arguments for the model's constructor, as a JSON object (e.g. '{\"num_classes\": 10}')")
    p.add_argument("--weights", metavar="PATH",
                   help="state-dict file to load into the model (torch.save'd; read with weights_only=True)")


def build_model(spec: str, args: argparse.Namespace, **library_defaults: object) -> object:
    """The model a command was asked for (`torchspeed.models.build`), with its --weights and --model-kwargs."""
    from torchspeed.models import build

    return build(spec, weights=getattr(args, "weights", None), model_kwargs=getattr(args, "model_kwargs", None),
                 **library_defaults)


def _renamed_flags(argv: list[str]) -> list[str]:
    """`argv` with each old flag of its command (`deprecated.FLAGS`) spelled the new way, saying so once."""
    command = next((a for a in argv if not a.startswith("-")), None)
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        new = FLAGS.get(f"{command} {flag}")
        if new is not None:
            print(f"torchspeed {command}: {flag} is now {new} (the old flag still works)", file=sys.stderr)
            arg = new + eq + value
        out.append(arg)
    return out


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH",
                   help="also write the measured figures as JSON to PATH ('-': JSON alone on stdout, tables on stderr)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
