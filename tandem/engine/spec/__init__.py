"""Speculative decoding: draft proposers and exact verification."""
