"""doctor's instrumentation in this process: the patch table is all that install() changes, and
uninstall() puts every original object back (identity, not equality)."""
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

from torchspeed.doctor.patches import PATCHES, AttrPatch, HookPatch
from torchspeed.doctor.recorder import Recorder

ATTRS = [p for p in PATCHES if isinstance(p, AttrPatch)]
HOOKS = [p for p in PATCHES if isinstance(p, HookPatch)]
MISSING = object()

# where each global hook lands (torch's registries)
REGISTRIES = {
    "torch.nn.modules.module:register_module_forward_pre_hook": nn_module._global_forward_pre_hooks,
    "torch.nn.modules.module:register_module_forward_hook": nn_module._global_forward_hooks,
    "torch.optim.optimizer:register_optimizer_step_pre_hook": optim_module._global_optimizer_pre_hooks,
    "torch.optim.optimizer:register_optimizer_step_post_hook": optim_module._global_optimizer_post_hooks,
}


def _neighbours():
    """Objects install() could plausibly touch, beyond the table's owners: a patch made outside the
    table would show up as a change in one of these."""
    import torch.nn.functional as F
    from torch.utils.data import dataloader as dl

    from torchspeed.data import FastLoader

    objs = {p.owner: p.target() for p in ATTRS}
    objs.update({"torch.nn:Module": nn.Module, "torch.optim:SGD": torch.optim.SGD, "torch.autograd": torch.autograd,
                 "torch.nn.functional": F, "torch": torch, "torch:Tensor": torch.Tensor,
                 "torch.utils.data.dataloader": dl, "dl:_SingleProcessDataLoaderIter": dl._SingleProcessDataLoaderIter,
                 "dl:_MultiProcessingDataLoaderIter": dl._MultiProcessingDataLoaderIter,
                 "torch.nn.modules.module": nn_module, "torch.optim.optimizer": optim_module,
                 "torch._C:TensorBase": torch._C.TensorBase, "torchspeed.data:FastLoader": FastLoader})
    return objs


def test_every_hook_patch_has_a_known_registry():
    assert {p.register for p in HOOKS} <= set(REGISTRIES)


def test_the_patch_table_is_all_that_install_changes():
    objs = _neighbours()
    before = {label: dict(vars(obj)) for label, obj in objs.items()}
    hooks_before = {name: len(reg) for name, reg in REGISTRIES.items()}
    rec = Recorder()
    rec.install()
    try:
        installed = rec.installed
        changed = {(label, k) for label, obj in objs.items() for k in set(before[label]) | set(vars(obj))
                   if vars(obj).get(k, MISSING) is not before[label].get(k, MISSING)}
        hooks_added = {name: len(reg) - hooks_before[name] for name, reg in REGISTRIES.items()}
    finally:
        rec.uninstall()
    assert installed == [p.name for p in PATCHES]  # every entry applies on this torch, in table order
    assert changed == {(p.owner, p.attr) for p in ATTRS}
    assert hooks_added == {name: sum(p.register == name for p in HOOKS) for name in REGISTRIES}
    assert rec.installed == []


def test_uninstall_puts_back_the_original_objects():
    def state(p):
        owner = p.target()
        return p.attr in vars(owner), vars(owner).get(p.attr, MISSING), getattr(owner, p.attr)

    originals = {p.name: state(p) for p in ATTRS}
    hooks = {name: dict(reg) for name, reg in REGISTRIES.items()}
    rec = Recorder()
    rec.install()
    try:
        for p in ATTRS:
            patched = getattr(p.target(), p.attr)
            assert patched is not originals[p.name][2], p.name
            assert patched.__name__ == originals[p.name][2].__name__ and patched.__doc__ == originals[p.name][2].__doc__
    finally:
        rec.uninstall()
    for p in ATTRS:
        own, stored, seen = state(p)
        was_own, was_stored, was_seen = originals[p.name]
        assert own == was_own and stored is was_stored and seen is was_seen, p.name
    for name, reg in REGISTRIES.items():
        assert dict(reg) == hooks[name], name
    rec.install()  # and it can be installed again
    rec.uninstall()


def test_installed_recorder_times_a_loop_and_stops_after_uninstall():
    loader, model = separable_loader(12, 4), tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def epoch():
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()

    rec = Recorder()
    rec.install()
    try:
        epoch()
    finally:
        rec.uninstall()
    assert rec.steps == 3 and len(rec.windows) == 3
    seen = {k for w in rec.windows for k, v in w["phases"].items() if v > 0}
    assert {"data", "forward", "backward", "optimizer"} <= seen
    (ld,) = rec.loaders.values()
    assert ld["num_workers"] == 0 and ld["batches"] == 3 and ld["training"]
    assert rec.s["backward_calls"] == 3 and rec.s["optimizers"] == ["SGD"]
    epoch()  # uninstalled: nothing more is recorded
    assert rec.steps == 3 and ld["batches"] == 3 and rec.s["backward_calls"] == 3
