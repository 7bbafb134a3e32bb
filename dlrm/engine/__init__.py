"""The engine both products train on: run loop, checkpoint store, collectives, process groups,
gradient sync, partitioning, random streams, atomic writes, the output rule and the error
vocabulary. It imports neither product (tests/test_layering.py); products import it."""
