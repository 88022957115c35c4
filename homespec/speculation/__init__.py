"""Speculative decoding, pure: the generation loop and its step, verification, sampling, the
controller and its estimates, and the proposers behind one protocol. Imports nothing from
homespec.llama or llama_cpp: the target is reached through the `Target` protocol."""
