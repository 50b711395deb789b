"""Decoding: sampling, draft trees, the drafter protocol, the lossless verify step, plain
decoding and the compiled speculative loop (draft -> verify -> commit), and their measured costs."""
