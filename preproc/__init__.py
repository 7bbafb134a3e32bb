"""Criteo preprocessing: raw click logs (TSV, hex hashes) -> split-binary datasets.

``generate`` writes synthetic logs in the Criteo format so every engine can be tested without
the 1 TB download; ``reference`` is the plain-Python transform the fast engines are checked
against.
"""
