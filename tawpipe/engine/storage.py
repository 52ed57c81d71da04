"""What one rank stores (design §6.1): its own chunk, the replicated modules, the staging buffers.

Device-bound storage: the own chunk's float32 master and float32 gradient accumulator are flat
buffers whose views are the optimizer's parameters and their ``.grad``; with ``offload_state``
they live in pinned host memory (``tawpipe.runtime.offload.HostOffload``) and stream to and
from the device: LOAD_W is issued on the weights channel, whose stream is not the compute
stream, and compute waits on the channel's event. The optimizer then steps on the host, where
the state lives: its parameters are views of the host master, so the state it creates is host
memory too, 16 B per parameter read and written there (on the device it would move 28 B per
parameter across PCIe every step instead). The replicated modules
(embedding, head) keep their own parameters, whose ``.grad`` are views of one flat buffer
``rep``, so the replicated all-reduce is one collective on memory that backward writes directly;
the rank's loss sum rides in the step's statistics instead (``loss_sum``), so ``rep`` can cross
in the gradients' wire dtype. Staging buffers are the plan's named buffers; with
``reuse_weights="host"`` each chunk the plan stashes (``STASH_W``) also has a compute-dtype copy
in pinned host memory, written right after the chunk's fetch and read back by ``RESTORE_W``.

Gradients are harvested without packing: the leaves a chunk's backward differentiates carry
persistent ``.grad`` views into the plan's gradient buffer (when the dtypes agree) or into one
compute-dtype scratch buffer, so autograd writes a chunk's gradient straight into flat memory.
A rank alone in its replica (world size 1, one rank per replica) has no gradient buffers where
the accumulator is on the device and gradients are float32 (``cost.memory.in_place_gradients``):
its backwards add into the accumulator, and its ACC_Gs do nothing.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..cost.memory import Savers, in_place_gradients
from ..models.parts import Materialize, block_param_name
from ..ops import ShardLayout
from ..plan.actions import Action, BufKind, Op, buf_kind
from ..plan.plan import Plan
from ..runtime.timeout import DEFAULT_TIMEOUT
from ..runtime.offload import HostOffload
from .host_step import piece_ranges
from .inputs import check_same_buffers
from .precision import squared_norm

BESIDE = (-1, -1)  # the carried load's master version while the host steps beside the next iteration

BlockForward = Callable[..., torch.Tensor]


class ChunkRunner(nn.Module):
    """A stack of blocks run through the user's hook; one per chunk shape, its parameters on the
    meta device: they always come from a staging buffer (``functional_call``). Its buffers are the
    blocks' constants, real (``ChunkStorage._template``)."""

    def __init__(self, blocks: nn.ModuleList, block_forward: BlockForward) -> None:
        super().__init__()
        self.blocks = blocks
        self._block_forward = block_forward

    def forward(self, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        for block in self.blocks:
            hidden = self._block_forward(block, hidden, **ctx)
        return hidden


@dataclass(frozen=True)
class MemoryReport:
    """Persistent per-rank bytes, by kind. `sharded_target` is 16 bytes x decoder parameters / N."""

    master: int
    optimizer: int
    grad_accumulator: int
    staging: dict[str, int]
    replicated: int
    decoder_params: int
    world_size: int
    offloaded: bool = False  # master, accumulator and optimizer state in host memory
    host_weights: int = 0  # stashed chunks in host memory (reuse_weights="host")

    @property
    def persistent(self) -> int:
        return self.master + self.optimizer + self.grad_accumulator

    @property
    def sharded_target(self) -> float:
        return 16.0 * self.decoder_params / self.world_size

    def __str__(self) -> str:
        mb = 1 / 2**20
        st = ", ".join(f"{k} {v * mb:.2f}" for k, v in sorted(self.staging.items()))
        return (
            f"master {self.master * mb:.2f} MiB + optimizer {self.optimizer * mb:.2f} + grad acc "
            f"{self.grad_accumulator * mb:.2f} = {self.persistent * mb:.2f} MiB "
            f"(16*Psi/N = {self.sharded_target * mb:.2f}){' in host memory' if self.offloaded else ''}; "
            f"staging: {st} MiB; replicated {self.replicated * mb:.2f} MiB"
            + (f"; stashed weights {self.host_weights * mb:.2f} MiB in host memory" if self.host_weights else "")
        )


class ChunkStorage:
    """The persistent tensors of one rank, laid out as the plan names them."""

    def __init__(self, plan: Plan, rank: int, blocks: Sequence[nn.Module],
                 replicated: list[tuple[str, nn.Parameter]], block_forward: BlockForward,
                 block_prefix: str, compute_dtype: torch.dtype, grad_dtype: torch.dtype,
                 device: torch.device, materialize: Materialize | None = None,
                 offload: bool = False, timeout: float = DEFAULT_TIMEOUT, layerwise: bool = False) -> None:
        self.plan, self.rank, self.device = plan, rank, device
        self.layerwise = layerwise  # backwards run a layer at a time (recompute "layer" or "block")
        self.compute_dtype, self.grad_dtype = compute_dtype, grad_dtype
        self.own_chunk = plan.own_chunk(rank)
        self.position = {k: p for p, k in enumerate(plan.model_order)}
        first = {stop - start: start for start, stop in reversed(plan.chunk_layers)}  # a chunk of each size
        self.layouts = {n: ShardLayout.from_module(nn.ModuleList(blocks[i:i + n]), align=1) for n, i in first.items()}
        self.layer_names = [f"blocks.0.{name}" for name, _ in blocks[0].named_parameters()]
        self.layer_layout = ShardLayout.from_module(blocks[0], align=1)  # layer j of a chunk: its j-th slice
        self.decoder_params = sum(p.numel() for b in blocks for p in b.parameters())
        # Which of each chunk's parameters train, in layout order: requires_grad as the blocks given
        # say (meta or not, every rank has every layer's, so the ranks agree). A frozen parameter
        # keeps its place in the flat buffers, but no leaf of it asks for a gradient, so its
        # gradient stays zero wherever it travels, and the optimizer never sees it.
        self.trainable = [tuple(p.requires_grad for b in blocks[start:stop] for p in b.parameters())
                          for start, stop in plan.chunk_layers]
        masks: dict[tuple[bool, ...], int] = {}
        self._mask = [masks.setdefault(m, len(masks)) for m in self.trainable]  # leaves are cached per mask
        own = self._init_own(blocks, block_prefix, materialize, offload, timeout)
        self.in_place = in_place_gradients(plan, rank, grad_dtype.itemsize, Savers(offload_state=offload))
        self._init_buffers(blocks, own)
        # The templates functional_call runs (design §6.2): one per chunk size, and one block, for
        # recomputing a chunk a layer at a time (every block has its structure, so every layer runs
        # through it with that layer's slice of the chunk's tensors).
        self.runners = {n: ChunkRunner(self._template(blocks[i:i + n]), block_forward) for n, i in first.items()}
        self.layer_runner = ChunkRunner(self._template(blocks[:1]), block_forward)
        self._init_replicated(replicated)
        self._init_staging()
        self._leaves: dict[tuple, list[torch.Tensor]] = {}  # weights(): (buf, "", n); leaves(): with the mask
        self.to_host = self.from_host = 0  # bytes moved with the host: the own state (offload), stashed weights
        # Offloaded, the own chunk's whole gradient is on the device as well as on the host in two
        # cases: the replicas' sum (ALLREDUCE_G, the last writer of the accumulator, sums a device
        # copy and copies it back), or else the one gradient buffer a single ACC_G adds to the
        # zeroed accumulator (a single node's plan with k = acc, world size 1 among them). There
        # its norm and non-finite check are taken from the device's. Elsewhere (several ACC_G, no
        # replicas) the host's sum is the only whole gradient, and the last ACC_G takes its norm
        # in the pass that adds it. Either way the host does not read its accumulator again for
        # the norm (``own_squared_norm``).
        acts = plan.actions[rank]
        additions = [a for a in acts if a.op is Op.ACC_G]
        summed = any(a.op is Op.ALLREDUCE_G for a in acts)
        self._norm_where = (None if self.offload is None else "replicas" if summed
                            else "addition" if len(additions) == 1 else "last addition")
        self._last_addition = additions[-1] if additions else None  # ACC_G runs in list order (it writes ACC)
        self._own_sq: torch.Tensor | None = None
        # Offloaded, a backward that runs a layer at a time hands each layer's gradient to the
        # host as it finishes it, where the plan's ACC_G of that gradient follows with nothing
        # touching it in between (design §6.1): the last layers' cross while the first run.
        self.streamed = (plan.streamed_accumulations(rank) if self.offload is not None and layerwise else {})
        self._streamed_additions = set(self.streamed.values())
        self._slice_sq: list[torch.Tensor] = []  # the last addition's slices' squared norms, so far
        # Offloaded, the step loads the own chunk for the next iteration as it steps it (``carry``)
        # into the buffer of the plan's ``carried_load``, which then does nothing.
        self.carried_load = plan.carried_load(rank) if self.offload is not None else None
        self._carried: tuple[int, int] | None = None  # the master (address, version) the carried load read

    def _init_own(self, blocks: Sequence[nn.Module], prefix: str, materialize: Materialize | None,
                  offload: bool, timeout: float) -> list[nn.Module]:
        """The own chunk's master, accumulator and parameters; its real blocks (materialised)."""
        start, stop = self.plan.chunk_layers[self.own_chunk]
        layout = self.layouts[stop - start]
        own = []
        for i in range(start, stop):
            block = blocks[i]
            if any(p.is_meta for p in block.parameters()):
                if materialize is None:
                    raise ValueError(f"block {i} is on the meta device: pass materialize=fn(block, layer_index) "
                                     "that returns it with its initial weights (only the own chunk's are asked)")
                block = materialize(block, i)
                if not isinstance(block, nn.Module) or any(p.is_meta for p in block.parameters()):
                    raise ValueError(f"materialize(block, {i}) must return the block with real weights")
                for (name, p), given in zip(block.named_parameters(), blocks[i].parameters()):
                    if given.requires_grad and not p.requires_grad:
                        raise ValueError(
                            f"materialize(block, {i}) returned the block with parameter {name!r} frozen "
                            "(requires_grad=False), but the block given has it trainable: every rank reads which "
                            "parameters train from the blocks given, for every layer, so freeze it there"
                        )
            own.append(block)
        modules = nn.ModuleList(own)
        master = layout.new_flat(torch.float32, "cpu" if offload else self.device)
        layout.pack([p.detach().to(master.device) for p in modules.parameters()], master)
        if not offload:
            self.offload, self.master, self.grad_acc = None, master, torch.zeros_like(master)
        else:  # master and accumulator in (pinned) host memory, streamed in pieces (design §6.1)
            self.offload = HostOffload(layout, self.device, init=master, timeout=timeout)
            self.master, self.grad_acc = self.offload.master, self.offload.grad
        self.own_params: list[tuple[str, nn.Parameter]] = []
        for (name, _), view, gview, trains in zip(modules.named_parameters(), layout.views(self.master),
                                                  layout.views(self.grad_acc), self.trainable[self.own_chunk]):
            p = nn.Parameter(view, requires_grad=trains)
            if trains:  # a frozen one has no gradient, as in torch
                p.grad = gview
            self.own_params.append((block_param_name(prefix, start, name), p))
        return own

    def _init_buffers(self, blocks: Sequence[nn.Module], own: list[nn.Module]) -> None:
        """The blocks' buffers, one real copy on the device that every layer's template shares
        (``check_block_buffers`` made sure they are constants every block has alike): from the
        first block given with real buffers, else from the own chunk's materialised ones. Floating
        ones are in the compute dtype, as the weights are (``block.to(compute_dtype)`` would)."""
        start, stop = self.plan.chunk_layers[self.own_chunk]
        check_same_buffers(own, range(start, stop))  # materialised ones were not compared yet
        source = next((b for b in [*blocks, *own] if not any(t.is_meta for t in b.buffers())), own[0])
        self.buffers: dict[str, torch.Tensor] = {}
        for name, t in source.named_buffers(remove_duplicate=False):
            if t.is_meta:
                raise ValueError(
                    f"the blocks' buffer {name!r} is on the meta device in every block this rank has: "
                    f"materialize(block, layer) must return the block with real buffers too (to_empty() leaves "
                    "them uninitialised: set them again, as the block's constructor does)"
                )
            dtype = self.compute_dtype if t.is_floating_point() else t.dtype
            self.buffers[name] = t.detach().to(self.device, dtype, copy=True)  # the engine's own, as the master
        self._buffer_versions = {name: t._version for name, t in self.buffers.items()}  # bumped by in-place ops

    def _template(self, blocks: Sequence[nn.Module]) -> nn.ModuleList:
        """``blocks`` as a template for ``functional_call``: parameters on the meta device (they
        always come from a staging buffer), buffers the shared real ones (``_init_buffers``)."""
        stack = copy.deepcopy(nn.ModuleList(blocks)).to("meta")
        for block in stack:
            for name, _ in list(block.named_buffers(remove_duplicate=False)):
                path, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(path), leaf, self.buffers[name])  # a buffer's name: stays a buffer
        return stack

    def check_buffers_unchanged(self) -> None:
        """After a forward: the blocks' buffers are as they were. Every layer shares one copy, and
        recompute runs forwards again, so a block that changes a buffer in its forward would make
        every layer see the others' changes: it fails here, naming the buffer, rather than train
        silently otherwise than the model it was given."""
        for name, t in self.buffers.items():
            if t._version != self._buffer_versions[name]:
                raise RuntimeError(
                    f"the blocks' forward changed their buffer {name!r} in place, but tawpipe runs every layer with "
                    "one copy of the blocks' buffers and runs forwards again to recompute, so they must be "
                    "constants: keep per-layer state out of the blocks' buffers (a frozen parameter, or "
                    "block_context)"
                )

    def _init_replicated(self, replicated: list[tuple[str, nn.Parameter]]) -> None:
        """``rep``: the flat gradient of the replicated parameters that train (frozen ones have
        none, as in torch, and their all-reduce carries nothing of them)."""
        self.replicated = replicated
        trained = [p for _, p in replicated if p.requires_grad]
        layout = ShardLayout.from_tensors(trained, align=1)
        self.rep = torch.zeros(layout.numel, dtype=torch.float32, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, view in zip(trained, layout.views(self.rep)):  # float32 on the device: the engine checked
            p.grad = view

    def _init_staging(self) -> None:
        names = {b for a in self.plan.actions[self.rank] for b in (a.buf, a.grad_buf) if b} - self.in_place
        numel = max(layout.numel for layout in self.layouts.values())
        dtype = {BufKind.WEIGHTS: self.compute_dtype, BufKind.GRADS: self.grad_dtype}
        # zeros, not empty: their pages are the rank's from the start (the first step writes them all)
        self.bufs = {b: torch.zeros(numel, dtype=dtype[buf_kind(b)], device=self.device) for b in sorted(names)}
        # Chunk gradients are born in compute dtype; when the plan's buffers hold another dtype
        # they land here first and are cast in one contiguous copy: a chunk's, or where the
        # backward runs a layer at a time, each layer's in turn (a layer's worth of scratch).
        scratch = self.layer_layout.numel if self.layerwise else numel
        self.scratch = (torch.empty(scratch, dtype=self.compute_dtype, device=self.device)
                        if self.compute_dtype != self.grad_dtype else None)
        stashed = sorted({a.chunk for a in self.plan.actions[self.rank] if a.op is Op.STASH_W})
        self.host = {c: torch.empty(self.numel(c), dtype=self.compute_dtype, pin_memory=self.device.type == "cuda")
                     for c in stashed}  # type: ignore[misc]

    def chunk(self, name: str, chunk: int) -> torch.Tensor:
        """The part of buffer ``name`` that holds ``chunk``."""
        return self.bufs[name][: self.numel(chunk)]

    def numel(self, chunk: int) -> int:
        start, stop = self.plan.chunk_layers[chunk]
        return self.layouts[stop - start].numel

    def layers(self, chunk: int) -> int:
        start, stop = self.plan.chunk_layers[chunk]
        return stop - start

    def weights(self, weight_buf: str, chunk: int) -> list[torch.Tensor]:
        """Per-parameter views of ``chunk`` in ``weight_buf`` (cached: the buffers never move)."""
        key = (weight_buf, "", self.layers(chunk))
        views = self._leaves.get(key)
        if views is None:
            views = self._leaves[key] = self.layouts[key[2]].views(self.bufs[weight_buf])
        return views

    def grad_target(self, grad_buf: str, chunk: int) -> torch.Tensor:
        """Where autograd writes a backward's chunk gradient (see the module docstring); a
        layerwise scratch is one layer's, all of it."""
        if self.scratch is not None:
            return self.scratch[: self.numel(chunk)]
        return self._gradients(grad_buf, chunk)

    def _gradients(self, grad_buf: str, chunk: int) -> torch.Tensor:
        """The plan's gradient buffer ``grad_buf`` holding ``chunk``, or the accumulator for it."""
        return self.grad_acc if grad_buf in self.in_place else self.chunk(grad_buf, chunk)

    def accumulates(self, a: Action) -> bool:
        """Whether B ``a`` adds its gradient to what its target holds (an accumulator always)."""
        return a.accumulate or a.grad_buf in self.in_place

    def leaves(self, weight_buf: str, grad_buf: str, chunk: int) -> list[torch.Tensor]:
        """Persistent leaf tensors viewing ``weight_buf`` whose ``.grad`` view the grad target
        (those of ``chunk``'s trainable parameters; the frozen ones ask for no gradient)."""
        n = self.layers(chunk)
        key = (weight_buf, grad_buf if self.scratch is None else "scratch", n, self._mask[chunk])
        leaves = self._leaves.get(key)
        if leaves is None:
            layout = self.layouts[n]
            leaves = [v.detach().requires_grad_(trains)  # frozen: no gradient, its slice stays zero
                      for v, trains in zip(layout.views(self.bufs[weight_buf]), self.trainable[chunk])]
            grads = (self.layer_layout.views(self.scratch) * n if self.scratch is not None and self.layerwise
                     else layout.views(self.grad_target(grad_buf, chunk)))  # every layer's: the one scratch
            for leaf, g in zip(leaves, grads):
                if leaf.requires_grad:
                    leaf.grad = g
            self._leaves[key] = leaves
        return leaves

    def layer_params(self, tensors: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A chunk's per-parameter ``tensors`` (``weights`` or ``leaves``, in layer order) as each
        layer's parameters of ``layer_runner``."""
        per = len(self.layer_names)
        return [dict(zip(self.layer_names, tensors[j:j + per])) for j in range(0, len(tensors), per)]

    def load_master(self, buf: str, chunk: int) -> None:
        """LOAD_W: the own master, cast into a staging buffer; nothing where the last step loaded
        it there already (``carry``) and the master is as that load read it."""
        dst = self.chunk(buf, chunk)
        if self.offload is None:
            dst.copy_(self.master)
            return
        a, read = self.carried_load, self._carried
        if read is not None and a is not None and (a.buf, a.chunk) == (buf, chunk):
            self._carried = None
            if read is BESIDE or read == self._master_version():
                return
        self.offload.load_weights_into(dst)
        self.from_host += self.master.nbytes  # the float32 master crosses, cast on the device

    def own_pieces(self) -> list[tuple[list[nn.Parameter], int, int]]:
        """The own chunk in the pieces the host steps it in (``engine.host_step``): each piece's
        parameters and its elements start..stop of the master."""
        return piece_ranges([p for _, p in self.own_params])

    def carry(self, start: int, stop: int) -> None:
        """Elements start..stop of the master, as the step has just left them, loaded into the
        buffer of ``carried_load`` for the next iteration (stream-ordered, as LOAD_W's)."""
        a = self.carried_load
        assert a is not None, "carry: this rank's plan carries no load"
        self.offload.load_weights_into(self.chunk(a.buf, a.chunk), start, stop)
        self.from_host += (stop - start) * self.master.element_size()

    def carried(self, stream: torch.cuda.Stream | None) -> None:
        """The step's loads are all issued: once they have read the master (waited for here) it
        may change, and ``stream`` (the weights channel's, on CUDA), which writes staging buffers
        next, is ordered after them. The next LOAD_W of ``carried_load`` finds them done."""
        self.offload.synchronize()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        self._carried = self._master_version()

    def carry_beside(self) -> None:
        """The step's loads are queued by the host's step beside the next iteration (design §6.1),
        each before the forward's layers that read it: the next LOAD_W of ``carried_load`` moves
        nothing (``carried_beside`` once that step is done, if no such LOAD_W ran meanwhile)."""
        self._carried = BESIDE

    def carried_beside(self) -> None:
        """The step beside is done and its loads have read the master: a carried load still to
        come checks the master against it, as after ``carried``."""
        if self._carried is BESIDE:
            self._carried = self._master_version()

    def piece_of_layer(self, stops: Sequence[int], layer: int) -> int:
        """The index of the piece (element ranges ending at ``stops``, in order) that holds the
        own chunk's layer ``layer``'s last element."""
        return bisect.bisect_right(stops, (layer + 1) * self.layer_layout.numel - 1)

    def before_program(self, actions: Iterable[Action]) -> None:
        """Another program than the step's runs next (evaluate): a carried load that it may
        overwrite, or whose master it may change, is forgotten (the next step loads again)."""
        if self.carried_load is not None and not self.plan.leaves_carried(self.carried_load, actions):
            self._carried = None

    def _master_version(self) -> tuple[int, int]:
        # in-place writes through the parameters (load_state_dict's copies, a user's) bump it
        return self.master.data_ptr(), self.master._version

    def stash(self, buf: str, chunk: int) -> None:
        """STASH_W: the chunk just fetched into ``buf``, copied to its host buffer (on the weights
        channel's stream: its later fetches and restores queue behind the copy)."""
        self.host[chunk].copy_(self.chunk(buf, chunk), non_blocking=True)
        self.to_host += self.host[chunk].nbytes

    def restore(self, buf: str, chunk: int) -> None:
        """RESTORE_W: the chunk's host copy back into a staging buffer."""
        self.chunk(buf, chunk).copy_(self.host[chunk], non_blocking=True)
        self.from_host += self.host[chunk].nbytes

    def accumulate(self, a: Action, layer: int | None = None) -> None:
        """ACC_G: a gradient buffer added into the own float32 accumulator. A streamed one
        (``streamed``) adds layer ``layer``'s slice of it as its backward finishes each, last
        layer first; its unit then has only the norm left to take where it is the device's."""
        if a.buf in self.in_place:
            return  # its backwards added it
        src = self.chunk(a.buf, a.chunk)
        if self.offload is None:
            self.grad_acc.add_(src)
            return
        streamed = a in self._streamed_additions
        if self._norm_where == "addition" and layer is None:
            self._own_sq = squared_norm(src)
        if streamed and layer is None:
            if a == self._last_addition and self._norm_where == "last addition":
                self._own_sq, self._slice_sq = torch.stack(self._slice_sq).sum(), []
            return
        per = self.layer_layout.numel
        start, stop = (0, src.numel()) if layer is None else (layer * per, (layer + 1) * per)
        if self._norm_where == "last addition" and a == self._last_addition:
            sq = self.offload.accumulate_grad(src, squared_norm=True, start=start, stop=stop)
            if layer is None:
                self._own_sq = sq
            else:  # the last layer's slice comes first: what an earlier, failed step left is dropped
                self._slice_sq = [sq] if (layer + 1) * per == src.numel() else [*self._slice_sq, sq]
        else:
            self.offload.accumulate_grad(src, start=start, stop=stop)
        self.to_host += (stop - start) * src.element_size()

    def summed_over_replicas(self, summed: torch.Tensor) -> None:
        """ALLREDUCE_G's sum of the own chunk's gradient over the replicas, the device copy of what
        an offloaded accumulator now holds: its norm is taken from it, not from the host's."""
        if self._norm_where == "replicas":
            self._own_sq = squared_norm(summed)

    def own_squared_norm(self) -> torch.Tensor | None:
        """The own chunk's squared gradient norm if it was taken on its way (``accumulate``,
        ``summed_over_replicas``), once per step, for the current stream (on the device it was
        made on the gradients' or the replicas'); None: take it from ``grad_acc``."""
        sq, self._own_sq = self._own_sq, None
        if sq is not None and sq.is_cuda:
            sq.record_stream(torch.cuda.current_stream())
        return sq

    def harvest(self, grad_buf: str, chunk: int, accumulate: bool, layer: int | None = None) -> None:
        """Move a backward's gradient from the scratch into the plan's buffer (dtype differs):
        the chunk's, or with a layerwise scratch layer ``layer``'s (its slice of the chunk)."""
        if self.scratch is not None:
            dst = self._gradients(grad_buf, chunk)
            if layer is not None:
                per = self.layer_layout.numel
                dst = dst[layer * per:(layer + 1) * per]
            src = self.scratch[: dst.numel()]
            dst.add_(src) if accumulate else dst.copy_(src)

    def memory_report(self, optimizer: torch.optim.Optimizer) -> MemoryReport:
        opt = sum(t.numel() * t.element_size() for _, p in self.own_params
                  for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0)
        staging = {k: v.numel() * v.element_size() for k, v in self.bufs.items()}
        host = sum(t.nbytes for t in self.host.values())
        if self.scratch is not None:
            staging["scratch"] = self.scratch.numel() * self.scratch.element_size()
        return MemoryReport(
            master=self.master.numel() * 4, optimizer=opt, grad_accumulator=self.grad_acc.numel() * 4,
            staging=staging, replicated=sum(p.numel() * p.element_size() for _, p in self.replicated),
            decoder_params=self.decoder_params, world_size=self.plan.replica_size,
            offloaded=self.offload is not None, host_weights=host,
        )
