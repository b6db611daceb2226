"""`MovesWithin`: the memory budget checked after every move a pipeline's session makes, from the tensors.

Subscribed to the session's moves as the tracer is (`session.observers`), after each one it measures, on the simulated
accelerator, the bytes of the storages of every component's tensors on the device (each storage once, through tensor
subclasses), less those of the blocks that stream (while one runs its tensors are views of the ring), plus the rings
the streaming components hold (`doe.offload_status(...).components[n].blocks.ring_bytes`): the device bytes of the
weights. It remembers the most and the number of moves seen."""

import torch

import diffusers_offload_ext as doe
from diffusers_offload_ext.marks import get_session
from diffusers_offload_ext.storages import tensor_parts


class MovesWithin:
    def __init__(self, pipe, sim, budget):
        self.pipe, self.sim, self.budget = pipe, sim, budget
        self.most, self.moves, self.over = 0, 0, []
        self.session = get_session(pipe)
        self.session.observers.append(self)

    def __call__(self, name, direction, module):
        return self.measure

    def measure(self, record):
        self.moves += 1
        status = doe.offload_status(self.pipe)
        rings, streamed = 0, set()
        for name, component in status.components.items():
            if component.blocks is not None:
                rings += component.blocks.ring_bytes
                module = getattr(self.pipe, name)
                for block in component.blocks.streamed:
                    sub = module.get_submodule(block)
                    streamed |= {id(t) for t in [*sub.parameters(), *sub.buffers()]}
        storages = {}
        for module in self.pipe.components.values():
            if not isinstance(module, torch.nn.Module):
                continue
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) in streamed:
                    continue
                for part in tensor_parts(tensor):
                    if self.sim.is_on_device(part):
                        storage = part.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        held = sum(storages.values()) + rings
        self.most = max(self.most, held)
        if held > self.budget:
            self.over.append((record, held))

    def remove(self):
        if self in self.session.observers:
            self.session.observers.remove(self)
