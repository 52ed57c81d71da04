"""The execution layer: runs action lists, moves bytes, launches and watches jobs.

``executor`` (channels and dataflow order, design §5), ``comm`` (the backend interface,
torch.distributed, native NCCL, recording wrappers), ``offload`` (a float32 state in pinned host
memory, streamed to and from a device: ``HostOffload``), ``progress`` (what each rank is doing,
for naming a stuck rank), ``timeout`` (the one default of every blocking wait), ``launch`` (local
jobs and torchrun; ``workers``, how a local job's workers start; ``fork_server``, what the
server that forks them imports). Imports ``tawpipe.plan``, ``tawpipe.ops`` (the prefetcher) and, for the
native backend, the extension; knows nothing of models or of the engine.
"""
