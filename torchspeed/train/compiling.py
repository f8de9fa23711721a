"""Regional compilation: the repeated blocks of a model (a transformer's layers) compiled in place, one
class at a time, so that torch.compile traces a block once and every other block of its class reuses that
code (Hugging Face Accelerate's `compile_regions`, PyTorch's regional-compilation recipe): the compile
seconds of one block instead of the whole model's, at about the same step time.

In place (`nn.Module.compile` on each block): the model keeps its class, its attributes and its
state_dict keys (no `_orig_mod.`), so a script that holds the model runs the compiled blocks (doctor's
compile fix), checkpoints load both ways, and `decompile_regions` puts the model back as it was.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["compile_regions", "compiled_regions", "decompile_regions", "eager_regions", "repeated_blocks"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _is_block(module: nn.Module) -> bool:
    """A block holds layers of its own or is the user's own class (a lone nn.Linear or nn.ReLU repeated in a
    Sequential is not a region worth compiling by itself)."""
    return next(module.children(), None) is not None or not type(module).__module__.startswith("torch.nn")


def repeated_blocks(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s repeated blocks, in module order: the children of an nn.ModuleList or
    nn.Sequential whose class occurs at least twice among that container's children (a GPT's
    `transformer.h.0` ... `transformer.h.11`, a ResNet's BasicBlocks). The outermost are taken: a block's
    own insides are compiled with it. Empty when the model repeats no block."""
    found: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        repeated: set[type] = set()
        if isinstance(module, _CONTAINERS):
            counts = Counter(type(c) for c in module.children() if _is_block(c))
            repeated = {cls for cls, n in counts.items() if n >= 2}
        for name, child in module.named_children():
            if type(child) in repeated:
                found.append(prefix + name)
            else:
                visit(child, f"{prefix}{name}.")

    visit(model, "")
    return found


def compile_regions(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile each of `model`'s repeated blocks in place (`block.compile(**compile_kwargs)`, the keywords of
    torch.compile) and return `model`. The first forward compiles one block per class and shape; the other
    blocks of that class reuse its code. The rest of the model (embeddings, head, loss) runs eagerly.

        model = compile_regions(model)      # model.transformer.h[i] run compiled; state_dict unchanged

    A model without repeated blocks is a ValueError (compile the whole model instead)."""
    names = repeated_blocks(model)
    if not names:
        raise ValueError(f"compile_regions: {type(model).__name__} has no repeated blocks (one module class at "
                         "least twice in an nn.ModuleList or nn.Sequential, such as a transformer's layers); "
                         "compile the whole model instead: torch.compile(model)")
    for name in names:
        model.get_submodule(name).compile(**compile_kwargs)
    return model


def compiled_regions(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s submodules compiled in place (by `compile_regions` or
    `module.compile()`), the model itself as ''."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def decompile_regions(model: nn.Module) -> None:
    """Undo `compile_regions` (and any `module.compile()` inside `model`): every submodule runs eagerly again,
    each exactly as before it was compiled."""
    for m in model.modules():
        m.__dict__.pop("_compiled_call_impl", None)


@contextlib.contextmanager
def eager_regions(model: nn.Module) -> Iterator[None]:
    """Inside, the compiled regions of `model` run eagerly, each module exactly as before it was compiled
    (so a whole-model compile traced then still matches it); afterwards compiled again, the compiled code
    kept. How a regionally compiled model is timed against its eager self, or its whole compile, without a
    second copy of its weights."""
    compiled = [(m, m.__dict__.pop("_compiled_call_impl")) for m in model.modules()
                if m.__dict__.get("_compiled_call_impl") is not None]
    try:
        yield
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl
