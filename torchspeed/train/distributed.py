"""torchrun's process group: formed once per launch attempt, the GPU of each rank, and the collectives
training needs (sums, a stop decision, every rank's RNG state, a barrier).

Everything here is a no-op in a single process, so the same training script runs unchanged with
`python train.py` and `torchrun --nproc_per_node=K train.py` (and torchrun's multi-node flags). Where
this process sits is read through `torchspeed.ranks`; which samples each rank reads is `data_order`.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import secrets
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchspeed import ranks

log = logging.getLogger(__name__)

__all__ = ["setup", "timeout", "attempt_generation", "cuda_index", "all_reduce_sums", "any_rank", "barrier",
           "gather_states"]


def cuda_index(local_rank: int, device_count: int, local_world_size: int | None = None,
               visible_devices: str | None = None) -> int:
    """The CUDA device index this process trains on.

    torchrun with one GPU per process: LOCAL_RANK. When every process is given its own GPU(s) through
    CUDA_VISIBLE_DEVICES (SLURM's one GPU per task), each sees them from index 0: LOCAL_RANK modulo
    the visible count (cuda:0 with one). Otherwise, more processes on this node than visible GPUs
    would share one (NCCL refuses, or rank 0 waits for a rank that crashed): a ValueError on every
    rank, before the process group, saying what to change.
    """
    if device_count < 1:
        raise ValueError("device 'cuda' was asked for, but no CUDA device is visible to this process (check "
                         "CUDA_VISIBLE_DEVICES and the driver), or train on the CPU with device='cpu'")
    if local_rank < device_count and (local_world_size is None or local_world_size <= device_count):
        return local_rank
    if visible_devices:  # each process was given its own device(s): they start at index 0 in every process
        return local_rank % device_count
    raise ValueError(
        f"{local_world_size or local_rank + 1} training processes on this node (LOCAL_RANK {local_rank}) but "
        f"{device_count} CUDA device(s) visible: processes would share a GPU. Launch at most {device_count} "
        f"per node (torchrun --nproc_per_node={device_count}), give each process its own GPU with "
        "CUDA_VISIBLE_DEVICES (as SLURM's --gpus-per-task does), or train on the CPU (device='cpu', gloo)")


def timeout() -> timedelta:
    """How long a collective (or forming the process group) waits for a peer before it fails:
    $TORCHSPEED_DIST_TIMEOUT seconds, else 600. A peer that dies is noticed at once (its connection
    closes); this bounds the wait for one that hangs, so a run ends with an error torchrun restarts
    from instead of waiting for ever. Long enough for rank 0 to measure accelerate()'s candidates
    while the others wait."""
    text = os.environ.get("TORCHSPEED_DIST_TIMEOUT", "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"TORCHSPEED_DIST_TIMEOUT={text!r}: give the seconds a collective may wait for a peer "
                         "(a positive number; 600 when unset)")
    return timedelta(seconds=seconds)


def attempt_generation(store: dist.Store, rank: int, world_size: int, wait: timedelta) -> int:
    """A number every rank of this launch attempt agrees on and no earlier attempt used.

    torchrun's agent keeps one store for the whole job: after a restart the keys of the dead
    attempt (each rank's gloo address, NCCL id, barrier counts) are still there, and a restarted rank
    reading them connects to a dead process ("connectFullMesh ... Connection refused") or waits for
    ever. TORCHELASTIC_RESTART_COUNT cannot tell attempts apart, as each node's agent counts only
    its own failures. So rank 0 draws the next number from the store, and each other rank asks for
    it under a nonce of its own, acknowledging what it got: a stale question is answered but never
    acknowledged under the new number, so only this attempt's ranks complete the exchange."""
    deadline = time.monotonic() + wait.total_seconds()
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"torchspeed/ask/{rank}", nonce)
        store.wait([f"torchspeed/answer/{nonce}"], wait)
        generation = int(store.get(f"torchspeed/answer/{nonce}"))
        store.set(f"torchspeed/ack/{generation}/{rank}", "1")
        return generation
    generation = int(store.add("torchspeed/generation", 1))
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            if store.check([f"torchspeed/ack/{generation}/{r}"]):
                pending.discard(r)
            elif store.check([f"torchspeed/ask/{r}"]):
                nonce = store.get(f"torchspeed/ask/{r}")
                if answered.get(r) != nonce:
                    store.set(f"torchspeed/answer/{nonce.decode()}", str(generation))
                    answered[r] = nonce
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {sorted(pending)} of {world_size} did not join the process group within "
                               f"{wait.total_seconds():.0f} s (TORCHSPEED_DIST_TIMEOUT); see their logs")
        if pending:
            time.sleep(0.01)
    return generation


def _store_of_this_attempt(e: ranks.DistEnv, wait: timedelta) -> dist.Store | None:
    """Under torchrun's shared agent store: that store, with keys of this attempt only (see
    `attempt_generation`). None elsewhere (init_process_group's own env:// store is fresh each launch)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not addr or not port.isdigit():
        return None
    store = dist.TCPStore(addr, int(port), e.world_size, is_master=False, timeout=wait)
    generation = attempt_generation(store, e.rank, e.world_size, wait)
    log.debug("process group of launch attempt %d (torchrun restart %s)", generation,
              os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"))
    return dist.PrefixStore(f"torchspeed/attempt-{generation}/", store)


def setup(device: torch.device) -> tuple[ranks.DistEnv, torch.device]:
    """Initialise the process group once (NCCL on CUDA, gloo on CPU) and pick this rank's device
    (`cuda_index`: a wrong LOCAL_RANK / device count is an error on every rank before any rank waits).

    Made to survive torchrun's restarts: every attempt forms its group on keys of its own
    (`attempt_generation`), and collectives wait at most `timeout()` for a peer."""
    e = ranks.env()
    if not e.distributed:
        return e, device
    if device.type == "cuda":
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        device = torch.device("cuda", cuda_index(e.local_rank, torch.cuda.device_count(),
                                                 int(lws) if lws and lws.isdigit() else None,
                                                 os.environ.get("CUDA_VISIBLE_DEVICES")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        wait = timeout()
        store = _store_of_this_attempt(e, wait)
        where = dict(store=store, rank=e.rank, world_size=e.world_size) if store is not None else {}
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=wait,
                                device_id=device if device.type == "cuda" else None, **where)
        atexit.register(_destroy_at_exit)
    return e, device


def _destroy_at_exit() -> None:
    """The process group `setup` formed, destroyed while the interpreter is still whole. Left to the
    interpreter's finalisation, gloo's worker threads can still hold work whose tensors need the GIL, and a
    rank that finished its training aborts (SIGABRT: "terminate called without an active exception"), which
    torchrun counts as a failed rank. A group the script destroyed itself is left alone, and so is the group
    of a rank ending on an error (an NCCL shutdown could wait on peers still in a collective: the rank fails
    either way, and torchrun's restart should not wait)."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        with contextlib.suppress(Exception):  # at exit, nothing left to tell: the peers may be gone already
            dist.destroy_process_group()


def all_reduce_sums(values: list[float]) -> list[float]:
    """Sum floats over all ranks (identity in one process)."""
    if not ranks.active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ranks.comm_device())
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any rank: stop decisions are agreed by all ranks."""
    return bool(all_reduce_sums([float(flag)])[0] > 0)


def gather_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state` (tensors and plain types, e.g. its RNG state), in rank order, on every rank
    (`[state]` in one process). Sent as torch.save bytes and read back with weights_only=True."""
    if not ranks.active():
        return [state]
    buf = io.BytesIO()
    torch.save(state, buf)
    dev = ranks.comm_device()
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = max(int(t.item()) for t in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in sizes]
    dist.all_gather(parts, padded)
    return [torch.load(io.BytesIO(p[:int(n.item())].cpu().numpy().tobytes()), weights_only=True)
            for p, n in zip(parts, sizes)]


def barrier() -> None:
    if ranks.active():
        dist.barrier()
