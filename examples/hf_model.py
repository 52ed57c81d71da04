"""Train a Hugging Face model with TawPipe, then load the result with transformers.

    python examples/hf_model.py                      # a small random LLaMA, saved locally first
    python examples/hf_model.py --model DIR          # any local save_pretrained directory
                                                     # (LLaMA, Mistral, Qwen, Gemma, Phi-3, ...)

Each of the 4 ranks (2 emulated nodes x 2) reads from the safetensors only its own chunk of
decoder layers plus the embedding and head, trains, and writes its own chunk back into a
save_pretrained directory that ``from_pretrained`` loads as usual. The data is bytes (vocabulary
256) of the Python standard library, so the model's vocabulary must be at least 256.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from tawpipe import TawPipe, Topology
from tawpipe.train.data import batch, load_tokens
from tawpipe.runtime.launch import run_local
from tawpipe.io.safetensors import export
from tawpipe.models import hf

MICRO_BATCHES, ROWS, SEQ = 2, 2, 64


def train(rank: int, model_dir: str, export_dir: str, steps: int) -> list[float]:
    parts = hf.from_pretrained(model_dir)  # meta model; embed and head real; blocks on demand
    engine = TawPipe(parts, topology=Topology(nodes=2, per_node=2), micro_batches=MICRO_BATCHES)
    tokens = load_tokens(None).train
    losses = []
    for step in range(steps):
        mbs = [batch(tokens, SEQ, ROWS, seed=0, step=step, index=rank * MICRO_BATCHES + i) for i in range(MICRO_BATCHES)]
        losses.append(engine.step((torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))))
    export(engine, parts, export_dir, torch.float32)  # every rank writes its own chunk
    engine.close()
    return losses


def small_llama(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local save_pretrained directory (default: a small random LLaMA)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--export", help="where to write the trained model (default: a temporary directory, "
                                         "removed at the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(Path(tmp, "initial"))
        if args.model is None:
            small_llama(Path(model_dir))
        export_dir = args.export or str(Path(tmp, "trained"))
        losses = run_local(train, 4, model_dir, export_dir, args.steps)[0]
        print(f"tawpipe: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")

        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(export_dir)
        x, y = batch(load_tokens(None).val, SEQ, ROWS, seed=0, step=0, index=0)
        with torch.no_grad():
            loss = F.cross_entropy(trained(input_ids=x).logits.flatten(0, 1), y.flatten())
        kept = f" ({export_dir})" if args.export else ""  # the temporary one is removed on the way out
        print(f"transformers, the exported model: held-out loss {loss.item():.3f}{kept}")


if __name__ == "__main__":
    main()
