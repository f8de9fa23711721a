"""A small CNN trained on an ImageFolder, written the way many tutorials write it (docs/doctor.md).

    python docs/examples/train_small_cnn.py DATA_DIR [--crop 96] [--batch-size 32] [--epochs 10]

PIL decodes every full-size photo in the training process (`num_workers=0`) and the model is small,
so the loop waits for data: the case `torchspeed doctor --try` answers with `fast_loader`.
"""
import argparse

import torch
from torch import nn
from torchvision import transforms
from torchvision.datasets import ImageFolder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("--crop", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    a = p.parse_args()
    tf = transforms.Compose([transforms.RandomResizedCrop(a.crop), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    dataset = ImageFolder(a.data_dir, tf)
    loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch_size, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, len(dataset.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(a.epochs):
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
