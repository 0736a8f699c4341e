"""Symmetric memory: buffers every rank of a group maps, signal pads, signal/wait, barriers."""
