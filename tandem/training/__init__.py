"""Offline training of speculative-decoding drafters (`tandem spec train`), outside the inference
core: it drives the engine to record the target's hidden states and tokens, then fits Medusa or
EAGLE heads or a draft model to them (distill.py)."""
