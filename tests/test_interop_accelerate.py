"""FastLoader through Hugging Face Accelerate: `Accelerator.prepare` prepares DataLoaders only and hands
any other iterable back unchanged, so a FastLoader is built on `accelerator.device` (it shards itself
by the process group / WORLD_SIZE and RANK) and trained in an ordinary Accelerate loop. Accelerate
is a test-only dependency, imported only here."""
import pytest
import torch
from helpers import tiny_convnet
from torch import nn

accelerate = pytest.importorskip("accelerate")


def test_fast_loader_through_accelerator_prepare(small_photo_folder):
    import torchspeed as ts

    accelerator = accelerate.Accelerator(cpu=True)
    loader = ts.data.fast_loader(small_photo_folder, batch_size=4, train=True, crop=32, device=accelerator.device,
                                 num_workers=0, threads=1)
    model = tiny_convnet()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader  # not a DataLoader: handed back as it is (no second sharding, no re-collation)
    steps = 0
    for _ in range(2):
        for images, labels in prepared:
            assert images.device == accelerator.device and images.dtype == torch.float32
            loss = nn.functional.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    assert steps == 2 * len(loader) == 4 and loader.epoch == 2  # each full pass is a new epoch (new shuffle)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))

