"""Compile once under DDP: the whole-model compile is of the model DDP wraps, so the graph the compile
trial compiled is the one that trains (no second compile around the wrapper), and a compile given without
a trial compiles the inner model once. torchrun on the CPU (gloo, 2 ranks); torch.compile counted with a
backend that records each graph it is handed."""
import json

from helpers import cpu_torchrun


SCRIPT = r'''
import json, os, sys
import torch
from torch import nn
import torch.distributed as dist
import torchspeed.train.compile_choice as compile_choice
from torchspeed.train import Trainer

out, rank = sys.argv[1], int(os.environ["RANK"])
calls, graphs = [], []
plain_compile = torch.compile


def counting_backend(gm, example_inputs):
    graphs.append(len(gm.graph.nodes))
    return gm.forward


def counted_compile(model, **kwargs):
    calls.append(type(model).__name__)
    return plain_compile(model, backend=counting_backend)


torch.compile = counted_compile
# the trial keeps the whole-model compile whatever this machine timed
compile_choice.weigh = lambda eager, options, horizon, margin: (
    "True", {"True": compile_choice.Verdict("kept: forced", 2.0, 1)})


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 3))


g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
found = {}
for case, compile_ in (("trial", "auto"), ("given", True)):
    calls.clear(), graphs.clear()
    torch._dynamo.reset()  # nothing compiled by the case before
    model = net()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, precision="fp32",
                 channels_last=False, compile=compile_, strategy="ddp", device="cpu", progress=False,
                 accelerate_kwargs={"min_compile_cost_s": 0.0, "expected_steps": 10 ** 6, "refresh": True})
    tr.prepare(data)
    prepared = (list(calls), len(graphs))
    tr.fit(data, epochs=2)
    found[case] = {"calls_prepared": prepared[0], "graphs_prepared": prepared[1], "calls": list(calls),
                   "graphs": len(graphs), "compile": tr.report.compile_setting, "strategy": tr.report.strategy,
                   "wrapped": type(tr.acc.wrapped).__name__,
                   "weights": [p.detach().flatten().tolist() for p in tr.module.parameters()]}
with open(os.path.join(out, f"compile_{rank}.json"), "w") as f:
    json.dump(found, f)
dist.destroy_process_group()
'''


def test_ddp_trains_the_graph_the_compile_trial_compiled(tmp_path):
    cpu_torchrun(SCRIPT, tmp_path, name="ddp_compile.py")
    r0, r1 = (json.loads((tmp_path / f"compile_{r}.json").read_text()) for r in (0, 1))
    for ranked in (r0, r1):
        trial, given = ranked["trial"], ranked["given"]
        assert trial["compile"] is True and trial["strategy"] == "ddp" and trial["wrapped"] == "DistributedDataParallel"
        # one torch.compile (the trial's, of the plain model) and no graph compiled after it: training reused it
        assert trial["calls"] == ["Sequential"] and trial["graphs_prepared"] >= 1
        assert trial["graphs"] == trial["graphs_prepared"]
        # compile given: no trial; the model DDP wraps is compiled once, on its first training step
        assert given["calls"] == ["Sequential"] and given["graphs_prepared"] == 0 and given["graphs"] >= 1
    for case in ("trial", "given"):  # DDP kept the ranks in step
        assert r0[case]["weights"] == r1[case]["weights"]
