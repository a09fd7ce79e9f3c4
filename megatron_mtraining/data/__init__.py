"""Data preparation helpers shared by the data tools (:mod:`.corpus`: JSONL corpora, cache directory,
licence table). Standard library only at import time."""
