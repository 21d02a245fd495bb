"""Whole MLP blocks and row-tiled chains of linear / norm / softmax.

Registered but empty for now.
"""
