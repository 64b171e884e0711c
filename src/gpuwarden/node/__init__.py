"""The broker of one node: its single-writer loop and what only that loop touches."""
