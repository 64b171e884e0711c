"""gpuwarden: a GPU job broker for the few GPUs that one person or a small team owns."""

__version__ = "0.1.0"
