"""How long torchspeed's measured decisions take on the first run of a script and on the next
(docs/train.md, "Decisions remembered"). Run it twice:

    python docs/examples/decide_twice.py PHOTO_FOLDER

Each line: the call, its wall time, and what it decided. The first run measures (and remembers); the
second decides from what the first remembered. `--refresh` measures again.
"""
import argparse
import logging
import time

import torch
import torchvision

import torchspeed as ts


def timed(name, call):
    t0 = time.perf_counter()
    out = call()
    print(f"{name:12s} {time.perf_counter() - t0:7.2f} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--refresh", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    for name in ("torchspeed.data", "torchspeed.infer"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the remembered / measured lines below are enough
    torch.manual_seed(0)
    loader = timed("fast_loader", lambda: ts.data.fast_loader(a.folder, batch_size=32, crop=96, device="cpu",
                                                              refresh=a.refresh))
    classes = len(loader.dataset.classes)
    model = torchvision.models.resnet18(num_classes=classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = timed("accelerate", lambda: ts.train.accelerate(model, optimizer, loader,
                                                                             refresh=a.refresh))
    report = ts.train.Accelerated.of(model).report
    print(f"  -> precision={report.precision} channels_last={report.channels_last}")
    net = torchvision.models.resnet18(num_classes=classes).eval()
    result = timed("optimize", lambda: ts.infer.optimize(net, torch.randn(1, 3, 96, 96), runtimes="torch",
                                                         batch_sizes=(1,), repeats=3, refresh=a.refresh))
    print(f"  -> {result.best.name}{' (' + result.remembered + ')' if result.remembered else ''}")


if __name__ == "__main__":
    main()
