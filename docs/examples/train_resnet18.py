"""A plain ResNet-18 training script, written the way many tutorials write it (docs/doctor.md).

    python docs/examples/train_resnet18.py DATA_DIR [--fast] [--crop 224] [--batch-size 32]

`--fast` swaps the DataLoader for torchspeed's fast_loader (the advice `torchspeed doctor` gives on
a 2-core CPU without AMX); everything else stays as written. `--crop` / `--batch-size` make a smaller
step for a quick look on a small machine.
"""
import argparse

import torch
import torchvision
from torch import nn
from torchvision import transforms
from torchvision.datasets import ImageFolder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("--fast", action="store_true")
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    a = p.parse_args()
    if a.fast:
        import torchspeed as ts

        loader = ts.data.fast_loader(a.data_dir, batch_size=a.batch_size, crop=a.crop, device="cpu", channels_last=False)
    else:
        tf = transforms.Compose([transforms.RandomResizedCrop(a.crop), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        loader = torch.utils.data.DataLoader(ImageFolder(a.data_dir, tf), batch_size=a.batch_size, shuffle=True,
                                             num_workers=0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(10):
        for images, labels in loader:
            loss = nn.CrossEntropyLoss()(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"epoch {epoch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
