"""The worker of test_spawn_on_free_port, in a module of its own: each spawned rank imports the module that defines its
function, and this one imports only ``torch.distributed`` (not pytest, not this package), a second less per rank."""

import gc

import torch.distributed as dist


def rendezvous(rank: int, world: int, port: int, fail: bool) -> None:
    gc.freeze()  # the rank exits after this call: its final garbage collection skips torch's objects (most of a second)
    if fail:  # before the rendezvous: its port is never bound, so no other process taking it can cause a retry
        raise ValueError("a failure of the worker itself")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    dist.destroy_process_group()
