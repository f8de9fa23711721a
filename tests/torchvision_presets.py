"""The transform presets of torchvision's reference training scripts (references/classification/presets.py),
trimmed to what decides the pixels: a small class whose `__call__` applies the `Compose` it holds in
`self.transforms`, built from torchvision's v1 transforms or, with `use_v2=True`, from `transforms.v2`; the
`backend` says whether the image becomes a tensor before the crops ("tensor") or after ("pil"). The way
people write transforms that doctor's data fix (torchspeed/doctor/datafix.py) must read."""
import torch
from torchvision import transforms as v1
from torchvision.transforms import v2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ClassificationPresetTrain:
    def __init__(self, *, crop_size, mean=MEAN, std=STD, hflip_prob=0.5, backend="pil", use_v2=False, extra=()):
        T = v2 if use_v2 else v1
        transforms = [T.PILToTensor()] if backend == "tensor" else []
        transforms.append(T.RandomResizedCrop(crop_size, antialias=True))
        if hflip_prob > 0:
            transforms.append(T.RandomHorizontalFlip(hflip_prob))
        transforms += list(extra)  # where the reference adds auto-augment policies
        if backend == "pil":
            transforms.append(T.PILToTensor())
        transforms += [T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                       T.Normalize(mean=mean, std=std)]
        if use_v2:
            transforms.append(T.ToPureTensor())
        self.transforms = T.Compose(transforms)

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetEval:
    def __init__(self, *, crop_size, resize_size, mean=MEAN, std=STD, backend="pil", use_v2=False):
        T = v2 if use_v2 else v1
        transforms = [T.PILToTensor()] if backend == "tensor" else []
        transforms += [T.Resize(resize_size, antialias=True), T.CenterCrop(crop_size)]
        if backend == "pil":
            transforms.append(T.PILToTensor())
        transforms += [T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                       T.Normalize(mean=mean, std=std)]
        if use_v2:
            transforms.append(T.ToPureTensor())
        self.transforms = T.Compose(transforms)

    def __call__(self, img):
        return self.transforms(img)
