"""MTP head: a one-layer draft head on the target's hidden states (EAGLE-style).

    weights.py   the target's frozen tensors from its GGUF (embedding, output rows, a decoder layer)
    collect.py   training data: the target's hidden states and next-token distributions
    model.py     the head (torch): fc -> one decoder layer -> norm -> reduced output projection
    train.py     training loop and checkpoint (models/<target>.mtp.safetensors + .json)
    ../proposers/mtp.py  serving: the head as a proposer

Only collect.py works without torch (`pip install homespec[mtp]` brings it).
"""
