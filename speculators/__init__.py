"""Draft models and prompt lookup that speculate on idle machines.

Not built yet: this package is filled by the speculation issue. Importing it
must never import Ray or llama.cpp.
"""
