"""How long a device computes: a LLaMA layer, the head, the embedding and a step (design §9.2).

Time is FLOPs over an achieved rate plus bytes over memory bandwidth, per micro-batch of T = B·S
tokens, on a model of ``ModelDims``:

- a layer's linear parts: 2·T·P_lin FLOPs forward (P_lin its matmul parameters), twice that
  backward; elementwise work (norms, rotary, SwiGLU, residuals) moves about 34·T·H activation
  elements forward and twice that backward (Korthikanti et al.'s count);
- causal attention: Q·Kᵀ and the weighted sum of V, 2·2·B·S²·H FLOPs halved by the mask, 2.5 times
  that backward (FlashAttention's backward recomputes the scores);
- with recompute, a backward runs its forward again first (twice under TawPipe's layer-wise
  recompute, ``Savers.forwards_in_backward``);
- the head: 2·T·H·V FLOPs forward, twice that backward, plus the float32 logits' softmax;
- AdamW: 32 bytes of memory traffic per float32 parameter (read weight, gradient and two moments,
  write three of them); a cast or an accumulation: the bytes it reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..models.shape import ModelDims
from ..models.spec import dims
from .hardware import Device

ADAMW_BYTES = 32  # memory traffic of one AdamW update of one float32 parameter
ELEMENTWISE = 34  # activation elements a layer's elementwise work reads and writes, per token and hidden unit
ATTENTION_BACKWARD = 2.5  # attention's backward over its forward (FlashAttention recomputes the scores)

def model(spec: str, *, seq: int, micro_batch: int, dtype_bytes: int = 2, grad_bytes: int = 2) -> ModelDims:
    """The model ``spec`` names (a built-in model of ``models.presets``, a Hugging Face
    ``config.json`` or its directory), trained with a fused attention kernel (FlashAttention: no
    S x S scores kept)."""
    return dims(spec, seq=seq, micro_batch=micro_batch, dtype_bytes=dtype_bytes, grad_bytes=grad_bytes,
                scores=False)


@dataclass(frozen=True)
class Workload:
    """Seconds of compute for ``dims`` on ``device``. ``recompute``: a backward runs its forward
    again (the engine's ``recompute="chunk"``, activation checkpointing in the peers).
    ``context``: context parallelism, the micro-batch's sequence split over that many ranks, of
    which ``dims.seq`` is one rank's share; its queries attend over the whole sequence, each rank
    doing 1/context of the causal attention (two mirrored slices per rank balance the mask)."""

    dims: ModelDims
    device: Device
    recompute: bool = True
    context: int = 1

    def sliced(self, context: int) -> "Workload":
        """This workload with each sequence split over ``context`` ranks (context parallelism): one
        rank's slice of it."""
        return replace(self, dims=replace(self.dims, seq=self.dims.seq // context), context=context)

    def kv_share_bytes(self) -> int:
        """Under context parallelism, one layer's keys and values of one micro-batch's slice: what
        a rank contributes to each K/V exchange (``cost.traffic.context_share_bytes``)."""
        # imported here, not at the top: with it there the ranks' calibration (test_cluster_compute's
        # idle credit, measured under a CPU quota) failed 4 runs of 5, here it passed each time
        from ..cost.traffic import context_share_bytes
        return context_share_bytes(replace(self.dims, seq=self.dims.seq * self.context), self.context)

    @property
    def tokens(self) -> int:
        return self.dims.seq * self.dims.micro_batch

    def linear_flops(self) -> float:
        """Forward FLOPs of one layer's matmuls for one micro-batch."""
        return 2 * self.tokens * (self.dims.layer_numel - 2 * self.dims.hidden)

    def attention_flops(self) -> float:
        """Forward FLOPs of one layer's causal attention products for one micro-batch."""
        d = self.dims
        return 2 * d.micro_batch * d.seq * d.seq * self.context * d.q_dim

    def layer_forward(self, micro_batches: int = 1) -> float:
        dev, d = self.device, self.dims
        elementwise = ELEMENTWISE * self.tokens * d.hidden * d.dtype_bytes / dev.memory_bandwidth
        return micro_batches * (self.linear_flops() / dev.matmul_flops
                                + self.attention_flops() / dev.attention_flops + elementwise)

    def layer_backward(self, micro_batches: int = 1, *, forwards: int | None = None) -> float:
        """The backward of one layer, with ``forwards`` forwards of it again first (default: one
        when ``recompute``; ``cost.memory.Savers.forwards_in_backward`` for TawPipe's savers)."""
        dev, d = self.device, self.dims
        elementwise = 2 * ELEMENTWISE * self.tokens * d.hidden * d.dtype_bytes / dev.memory_bandwidth
        back = micro_batches * (2 * self.linear_flops() / dev.matmul_flops
                                + ATTENTION_BACKWARD * self.attention_flops() / dev.attention_flops + elementwise)
        again = int(self.recompute) if forwards is None else forwards
        return back + again * self.layer_forward(micro_batches)

    def head(self, micro_batches: int = 1) -> float:
        """The head and loss, forward and backward (float32 logits, softmax, their gradient)."""
        d, dev = self.dims, self.device
        flops = 6 * self.tokens * d.hidden * d.vocab
        return micro_batches * (flops / dev.matmul_flops + 3 * self.tokens * d.vocab * 4 / dev.memory_bandwidth)

    def embed(self, micro_batches: int = 1) -> float:
        """The embedding's lookup and its gradient's scatter-add."""
        return micro_batches * 3 * self.tokens * self.dims.hidden * 4 / self.device.memory_bandwidth

    def step(self, params: float) -> float:
        """AdamW on ``params`` float32 parameters."""
        return params * ADAMW_BYTES / self.device.memory_bandwidth

    def host_step(self, params: float, bandwidth: float) -> float:
        """AdamW on ``params`` float32 parameters on a host that gives it ``bandwidth`` bytes/s."""
        return params * ADAMW_BYTES / bandwidth

    def copy(self, nbytes: float) -> float:
        """A local cast, copy or accumulation that reads and writes ``nbytes`` in all."""
        return nbytes / self.device.memory_bandwidth
