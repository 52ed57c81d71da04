"""Files in and out of a running engine, through its public methods only.

``checkpoint`` (atomic, checksummed, reshardable checkpoints with a manifest) and
``safetensors`` (a trained model written as a Hugging Face ``save_pretrained`` directory, each
rank its own chunk). Imports ``engine``, ``models`` and the layers below.
"""
