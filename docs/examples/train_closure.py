"""A training loop that runs forward and backward inside `optimizer.step(closure)`, the way
Lightning's automatic optimisation trains every model (docs/doctor.md).

    python docs/examples/train_closure.py DATA_DIR
"""
import sys

import torch
import torchvision
from torch import nn
from torchvision import transforms
from torchvision.datasets import ImageFolder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main() -> None:
    tf = transforms.Compose([transforms.RandomResizedCrop(112), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    loader = torch.utils.data.DataLoader(ImageFolder(sys.argv[1], tf), batch_size=32, shuffle=True)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(10):
        for images, labels in loader:
            def closure():
                optimizer.zero_grad()
                loss = loss_fn(model(images), labels)
                loss.backward()
                return loss

            loss = optimizer.step(closure)
            print(f"epoch {epoch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
